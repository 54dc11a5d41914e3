"""Tests for aioreplica._backends._hostreduce: the blocked reduction kernel and the buffer pool."""

from __future__ import annotations

import gc
import itertools
import mmap
import threading
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aioreplica._backends import _hostreduce
from aioreplica._backends._hostreduce import (
    BLOCK_BYTES,
    HUGE_BYTES,
    MIN_RANGE_BYTES,
    BufferPool,
    empty_buffer,
    reduce_range,
    split_ranges,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    import numpy.typing as npt

OPS = ("sum", "mean", "max", "min", "prod")
REAL_DTYPES = ("float32", "float64", "int32", "int64")
COMPLEX_OPS = ("sum", "mean", "prod")


def _inputs(n: int, shape: tuple[int, ...], dtype: str, seed: int = 0) -> list[npt.NDArray[Any]]:
    """N random arrays; integers stay small enough that exact comparisons make sense."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    out = []
    for _ in range(n):
        if dt.kind in "iu":
            x = rng.integers(-50, 50, size=shape).astype(dt)
        elif dt.kind == "c":
            x = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
        else:
            x = rng.standard_normal(shape).astype(dt)
        out.append(x)
    return out


def _expected(op: str, inputs: list[npt.NDArray[Any]]) -> npt.NDArray[Any]:
    """NumPy's own reduction over a stack of the inputs, in the inputs' dtype."""
    stack = np.stack(inputs)
    dtype = inputs[0].dtype
    reductions: dict[str, Callable[[], object]] = {
        "sum": lambda: np.sum(stack, axis=0, dtype=dtype),
        "mean": lambda: np.mean(stack, axis=0, dtype=dtype),
        "max": lambda: np.max(stack, axis=0),
        "min": lambda: np.min(stack, axis=0),
        "prod": lambda: np.prod(stack, axis=0, dtype=dtype),
    }
    return np.asarray(reductions[op]())


def _assert_matches(got: npt.NDArray[Any], want: npt.NDArray[Any]) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    if got.dtype.kind in "fc":
        tol = 1e-5 if got.dtype.itemsize <= 8 and got.dtype != np.float64 else 1e-12
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, want)


def _reduce(op: str, inputs: list[npt.NDArray[Any]], parts: int = 1) -> npt.NDArray[Any]:
    out = np.empty_like(inputs[0])
    ranges = split_ranges(out.size, out.itemsize, parts) if parts > 1 else [(0, out.size)]
    for start, stop in ranges:
        reduce_range(op, inputs, out, start, stop)
    return out


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Blocks of 64 bytes and ranges of at least 256 bytes, so small arrays span many blocks."""
    monkeypatch.setattr(_hostreduce, "BLOCK_BYTES", 64)
    monkeypatch.setattr(_hostreduce, "MIN_RANGE_BYTES", 256)
    return 64


class TestReduceRange:
    @pytest.mark.parametrize("n", [1, 2, 3, 8])
    @pytest.mark.parametrize(
        ("op", "dtype"),
        [(op, dt) for op in OPS for dt in REAL_DTYPES if op != "mean" or dt.startswith("float")],
    )
    def test_matches_numpy_for_real_dtypes(self, op: str, dtype: str, n: int) -> None:
        """Every op agrees with NumPy's reduction over a stack, for real dtypes and N inputs."""
        inputs = _inputs(n, (7, 143), dtype)
        _assert_matches(_reduce(op, inputs), _expected(op, inputs))

    @pytest.mark.parametrize("n", [1, 2, 3, 8])
    @pytest.mark.parametrize("op", COMPLEX_OPS)
    def test_matches_numpy_for_complex64(self, op: str, n: int) -> None:
        """Sum, mean and prod agree with NumPy on complex64."""
        inputs = _inputs(n, (1001,), "complex64")
        _assert_matches(_reduce(op, inputs), _expected(op, inputs))

    @pytest.mark.parametrize("size", [1, 7, 15, 16, 17, 1023])
    @pytest.mark.parametrize("op", OPS)
    @pytest.mark.usefixtures("small_blocks")
    def test_odd_sizes_across_many_blocks(self, op: str, size: int) -> None:
        """Sizes that do not divide into blocks reduce correctly, partial last block included."""
        for dtype in ("float32", "int64"):
            if op == "mean" and dtype == "int64":
                continue
            inputs = _inputs(3, (size,), dtype, seed=size)
            _assert_matches(_reduce(op, inputs), _expected(op, inputs))

    @pytest.mark.parametrize("parts", [2, 3, 5, 16])
    @pytest.mark.parametrize("op", OPS)
    @pytest.mark.usefixtures("small_blocks")
    def test_ranges_in_several_parts_cover_the_array(self, op: str, parts: int) -> None:
        """Reducing the ranges of split_ranges one after another gives the whole result."""
        inputs = _inputs(4, (37, 29), "float64", seed=parts)
        assert len(split_ranges(37 * 29, 8, parts)) == min(parts, 37 * 29 * 8 // 256)
        _assert_matches(_reduce(op, inputs, parts), _expected(op, inputs))

    def test_multiblock_with_the_real_block_size(self) -> None:
        """An array of several real blocks plus a partial one, split in parts, is exact."""
        size = 3 * BLOCK_BYTES // 4 + 13
        inputs = _inputs(3, (size,), "float32", seed=3)
        _assert_matches(_reduce("sum", inputs, parts=2), _expected("sum", inputs))

    def test_only_the_range_is_written(self) -> None:
        """Elements outside [start, stop) keep their old values."""
        inputs = _inputs(2, (100,), "int64")
        out = np.full(100, -7, dtype=np.int64)
        reduce_range("sum", inputs, out, 10, 35)
        want = inputs[0] + inputs[1]
        np.testing.assert_array_equal(out[10:35], want[10:35])
        assert (out[:10] == -7).all()
        assert (out[35:] == -7).all()

    def test_one_input_is_copied(self) -> None:
        """N == 1 copies the input into out without sharing memory."""
        (x,) = _inputs(1, (5, 3), "float32")
        for op in OPS:
            out = np.zeros_like(x)
            reduce_range(op, [x], out, 0, x.size)
            np.testing.assert_array_equal(out, x)
            assert not np.shares_memory(out, x)

    @pytest.mark.parametrize("op", OPS)
    def test_zero_dimensional_arrays(self, op: str) -> None:
        """0-d inputs reduce to a 0-d result."""
        inputs = [np.array(v, dtype=np.float64) for v in (1.5, -2.0, 4.0)]
        out = np.empty((), dtype=np.float64)
        reduce_range(op, inputs, out, 0, 1)
        _assert_matches(out, _expected(op, inputs))

    @pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 2)])
    def test_empty_arrays(self, shape: tuple[int, ...]) -> None:
        """Empty arrays reduce over the empty range and touch nothing."""
        inputs = [np.empty(shape, np.float32) for _ in range(3)]
        out = np.empty(shape, np.float32)
        reduce_range("sum", inputs, out, 0, 0)
        assert out.shape == shape

    def test_empty_range_of_a_nonempty_array_writes_nothing(self) -> None:
        """start == stop leaves out untouched."""
        inputs = _inputs(2, (8,), "int32")
        out = np.zeros(8, np.int32)
        reduce_range("prod", inputs, out, 4, 4)
        assert not out.any()

    def test_mean_divides_the_sum_by_n(self) -> None:
        """mean is the sum scaled by 1/N, exactly where the values allow it."""
        inputs = [np.full(10, v, dtype=np.float64) for v in (1.0, 2.0, 6.0)]
        out = np.empty(10)
        reduce_range("mean", inputs, out, 0, 10)
        np.testing.assert_array_equal(out, np.full(10, 3.0))

    @pytest.mark.parametrize("op", ["max", "min", "sum"])
    def test_nan_propagates_like_numpy(self, op: str) -> None:
        """A NaN in any input gives NaN in that element, as NumPy's reductions do."""
        inputs = _inputs(3, (6,), "float64")
        inputs[1][2] = np.nan
        got = _reduce(op, inputs)
        assert np.isnan(got[2])
        _assert_matches(got, _expected(op, inputs))

    def test_integer_overflow_wraps_in_the_input_dtype(self) -> None:
        """Integer results keep the inputs' dtype and wrap around as NumPy's arithmetic does."""
        top = np.iinfo(np.int32).max
        inputs = [np.full(4, top, np.int32), np.full(4, 2, np.int32)]
        got = _reduce("sum", inputs)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.full(4, np.iinfo(np.int32).min + 1, np.int32))

    def test_ranges_reduced_in_parallel_threads(self) -> None:
        """Two threads reducing their own ranges of one output produce the whole result."""
        size = 4 * MIN_RANGE_BYTES // 4 + 5
        inputs = _inputs(4, (size,), "float32", seed=9)
        out = np.empty(size, np.float32)
        ranges = split_ranges(size, 4, 2)
        assert len(ranges) == 2
        errors: list[BaseException] = []

        def work(start: int, stop: int) -> None:
            try:
                reduce_range("sum", inputs, out, start, stop)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=r) for r in ranges]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        _assert_matches(out, _expected("sum", inputs))

    def test_unknown_op_is_refused(self) -> None:
        """An op that is not one of the five names raises ValueError listing them."""
        x = np.ones(3)
        with pytest.raises(ValueError, match=r"unknown reduction 'avg'.*'max', 'mean'"):
            reduce_range("avg", [x, x], np.empty(3), 0, 3)

    def test_no_inputs_is_refused(self) -> None:
        """An empty input sequence raises ValueError."""
        with pytest.raises(ValueError, match="at least one input"):
            reduce_range("sum", [], np.empty(3), 0, 3)

    def test_mismatched_dtype_is_refused(self) -> None:
        """An input whose dtype differs from out raises TypeError naming it."""
        with pytest.raises(TypeError, match=r"inputs\[1\] has dtype float32, out has float64"):
            reduce_range("sum", [np.ones(3), np.ones(3, np.float32)], np.empty(3), 0, 3)

    def test_mismatched_shape_is_refused(self) -> None:
        """An input whose shape differs from out raises ValueError naming it."""
        with pytest.raises(ValueError, match=r"inputs\[0\] has shape \(4,\), out has \(3,\)"):
            reduce_range("sum", [np.ones(4)], np.empty(3), 0, 3)

    def test_non_contiguous_input_is_refused(self) -> None:
        """A strided input raises ValueError instead of being copied silently."""
        x = np.ones(6)[::2]
        with pytest.raises(ValueError, match=r"inputs\[1\] must be C-contiguous"):
            reduce_range("sum", [np.ones(3), x], np.empty(3), 0, 3)

    def test_non_array_input_is_refused(self) -> None:
        """A list where an array belongs raises TypeError."""
        bad: Any = [1.0, 2.0]
        with pytest.raises(TypeError, match=r"inputs\[0\] must be a numpy\.ndarray, got list"):
            reduce_range("sum", [bad], np.empty(2), 0, 2)

    def test_read_only_out_is_refused(self) -> None:
        """A read-only out raises ValueError before anything is written."""
        out = np.zeros(3)
        out.flags.writeable = False
        with pytest.raises(ValueError, match="out is read-only"):
            reduce_range("sum", [np.ones(3)], out, 0, 3)

    def test_out_overlapping_an_input_is_refused(self) -> None:
        """out sharing memory with an input raises ValueError naming the input."""
        x = np.ones(3)
        with pytest.raises(ValueError, match=r"out shares memory with inputs\[1\]"):
            reduce_range("sum", [np.ones(3), x], x, 0, 3)

    @pytest.mark.parametrize(("start", "stop"), [(-1, 2), (2, 1), (0, 4)])
    def test_range_out_of_bounds_is_refused(self, start: int, stop: int) -> None:
        """A range outside [0, size] or reversed raises ValueError."""
        with pytest.raises(ValueError, match=rf"range \[{start}, {stop}\) is not within"):
            reduce_range("sum", [np.ones(3)], np.empty(3), start, stop)

    @pytest.mark.parametrize("dtype", ["int32", "bool"])
    def test_mean_of_integers_is_refused(self, dtype: str) -> None:
        """mean of a bool or integer dtype raises TypeError."""
        x = np.ones(3, dtype)
        with pytest.raises(
            TypeError, match=f"'mean' needs a floating or complex dtype, got {dtype}"
        ):
            reduce_range("mean", [x, x], np.empty(3, dtype), 0, 3)

    def test_non_numeric_dtype_is_refused(self) -> None:
        """Object arrays (whose ufuncs hold the GIL) raise TypeError."""
        x = np.array([1, 2], dtype=object)
        with pytest.raises(TypeError, match="cannot reduce dtype object"):
            reduce_range("sum", [x, x.copy()], np.empty(2, object), 0, 2)


def _check_ranges(size: int, itemsize: int, parts: int, ranges: list[tuple[int, int]]) -> None:
    block = max(1, _hostreduce.BLOCK_BYTES // itemsize)
    assert 1 <= len(ranges) <= parts
    assert ranges[0][0] == 0
    assert ranges[-1][1] == size
    for (_, stop), (start, _) in itertools.pairwise(ranges):
        assert stop == start
    for start, stop in ranges:
        assert start < stop
        assert start % block == 0
    if len(ranges) > 1:
        assert all(
            (stop - start) * itemsize >= _hostreduce.MIN_RANGE_BYTES for start, stop in ranges
        )


class TestSplitRanges:
    @given(
        size=st.integers(1, 1 << 31),
        itemsize=st.sampled_from([1, 2, 4, 8, 16]),
        parts=st.integers(1, 16),
    )
    def test_ranges_tile_the_array_on_block_boundaries(
        self, size: int, itemsize: int, parts: int
    ) -> None:
        """Ranges are contiguous, non-empty, block-aligned, cover [0, size) and are <= parts."""
        _check_ranges(size, itemsize, parts, split_ranges(size, itemsize, parts))

    @given(
        size=st.integers(1, 1 << 31),
        itemsize=st.sampled_from([1, 2, 4, 8, 16]),
        parts=st.integers(1, 16),
    )
    def test_as_many_ranges_as_the_minimum_size_allows(
        self, size: int, itemsize: int, parts: int
    ) -> None:
        """The count is parts, or fewer only when ranges would drop under MIN_RANGE_BYTES."""
        want = min(parts, max(1, size * itemsize // MIN_RANGE_BYTES))
        assert len(split_ranges(size, itemsize, parts)) == want

    @given(
        size=st.integers(1, 10_000),
        itemsize=st.sampled_from([1, 3, 4, 12]),
        parts=st.integers(1, 8),
    )
    def test_tiny_blocks_and_odd_itemsizes(self, size: int, itemsize: int, parts: int) -> None:
        """Block and minimum sizes that are not multiples of the itemsize still tile correctly."""
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_hostreduce, "BLOCK_BYTES", 40)
            mp.setattr(_hostreduce, "MIN_RANGE_BYTES", 100)
            _check_ranges(size, itemsize, parts, split_ranges(size, itemsize, parts))

    def test_ranges_are_balanced_to_a_block(self) -> None:
        """Range lengths differ by at most one block."""
        block = BLOCK_BYTES // 4
        ranges = split_ranges(37 * block + 3, 4, 4)
        lengths = [stop - start for start, stop in ranges[:-1]]
        assert max(lengths) - min(lengths) <= block
        assert len(ranges) == 4

    def test_small_array_is_one_range(self) -> None:
        """An array under twice MIN_RANGE_BYTES is not split."""
        size = (2 * MIN_RANGE_BYTES - 1) // 8
        assert split_ranges(size, 8, 8) == [(0, size)]

    def test_one_part_is_the_whole_array(self) -> None:
        """parts == 1 gives the whole array as one range."""
        assert split_ranges(10**8, 4, 1) == [(0, 10**8)]

    def test_empty_array_has_no_ranges(self) -> None:
        """size == 0 gives an empty list."""
        assert split_ranges(0, 4, 3) == []

    @pytest.mark.parametrize(("size", "itemsize", "parts"), [(-1, 4, 1), (4, 0, 1), (4, 4, 0)])
    def test_bad_arguments_are_refused(self, size: int, itemsize: int, parts: int) -> None:
        """Negative size, itemsize < 1 or parts < 1 raise ValueError quoting them."""
        with pytest.raises(
            ValueError, match=f"got size={size}, itemsize={itemsize}, parts={parts}"
        ):
            split_ranges(size, itemsize, parts)


class TestBlockSize:
    def test_block_is_a_power_of_two_within_bounds(self) -> None:
        """The block size in use is a power of two between 64 KiB and 1 MiB."""
        assert 64 << 10 <= BLOCK_BYTES <= 1 << 20
        assert BLOCK_BYTES & (BLOCK_BYTES - 1) == 0
        assert MIN_RANGE_BYTES % BLOCK_BYTES == 0

    @pytest.mark.parametrize(
        ("share", "block"),
        [
            (None, 256 << 10),
            (0, 256 << 10),
            (1 << 20, 512 << 10),
            (512 << 10, 256 << 10),
            (3 << 20, 1 << 20),
            (96 << 10, 64 << 10),
            (1280 << 10, 512 << 10),
        ],
    )
    def test_block_is_half_the_l2_share(self, share: int | None, block: int) -> None:
        """Half the L2 share, rounded down to a power of two and clamped; 256 KiB if unknown."""
        assert _hostreduce._block_bytes(share) == block

    def test_l2_share_is_read_from_sysfs(self, tmp_path: Path) -> None:
        """The L2 size is divided by the CPUs sharing it, as sysfs lists them."""
        for name, files in {
            "index0": {"level": "1", "type": "Data", "size": "32K", "shared_cpu_list": "0"},
            "index2": {
                "level": "2",
                "type": "Unified",
                "size": "2048K",
                "shared_cpu_list": "0-1,4",
            },
        }.items():
            (tmp_path / name).mkdir()
            for key, text in files.items():
                (tmp_path / name / key).write_text(text + "\n")
        assert _hostreduce._l2_share_bytes(tmp_path) == (2048 << 10) // 3

    def test_missing_sysfs_gives_none(self, tmp_path: Path) -> None:
        """Without sysfs cache entries the L2 share is unknown."""
        assert _hostreduce._l2_share_bytes(tmp_path / "absent") is None


class TestEmptyBuffer:
    def test_small_is_numpys_own(self) -> None:
        """Below HUGE_BYTES: an ordinary np.empty array, owning its memory."""
        buf = empty_buffer((3, 5), np.dtype("int32"))
        assert buf.shape == (3, 5)
        assert buf.dtype == np.int32
        assert buf.base is None
        assert buf.flags.writeable
        assert buf.flags.c_contiguous

    @pytest.mark.skipif(not _hostreduce._HUGE_PAGES, reason="huge pages are Linux's")
    def test_large_is_mapped_on_its_own_for_huge_pages(self) -> None:
        """From HUGE_BYTES up: writeable, C-contiguous, starting a page and a cache line past
        a 2 MiB boundary, and the owner of its memory as views see it (their base is the
        buffer, not the mapping)."""
        buf = empty_buffer((2, HUGE_BYTES // 8), np.dtype("float32"))
        assert buf.shape == (2, HUGE_BYTES // 8)
        assert buf.dtype == np.float32
        assert buf.flags.writeable
        assert buf.flags.c_contiguous
        assert buf.ctypes.data % (2 << 20) == 4096 + 64
        assert buf[1:].base is buf
        assert buf.reshape(-1)[::2].base is buf
        buf[:] = 3.0
        assert float(buf.sum()) == 3.0 * buf.size

    def test_no_mapping_falls_back_to_numpy(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A mapping that cannot be made (out of address space): np.empty's array instead."""

        def refuse(*args: object, **kwargs: object) -> None:
            raise OSError(12, "Cannot allocate memory")

        monkeypatch.setattr(mmap, "mmap", refuse)
        buf = empty_buffer((HUGE_BYTES // 4,), np.dtype("float32"))
        assert buf.shape == (HUGE_BYTES // 4,)
        assert buf.base is None


def _address(array: npt.NDArray[Any]) -> int:
    """Where an array's first element is in memory."""
    address: int = array.__array_interface__["data"][0]
    return address


def _base(array: npt.NDArray[Any]) -> Any:
    """``array.base``: for a huge buffer a mapping, which NumPy's stubs do not expect."""
    return array.base


def _view_makers() -> list[Any]:
    makers: list[tuple[str, Callable[[npt.NDArray[Any]], object]]] = [
        ("slice", lambda a: a[1:]),
        ("reshape", lambda a: a.reshape(2, -1)),
        ("transpose", lambda a: a.reshape(2, -1).T),
        ("view_dtype", lambda a: a.view(np.uint8)),
        ("view_of_view", lambda a: a[2:][::2]),
        ("asarray", lambda a: np.asarray(a)),
        ("memoryview", lambda a: a.data),
        ("frombuffer", lambda a: np.frombuffer(a, dtype=np.float32)),
        ("in_a_list", lambda a: [a]),
        ("base", lambda a: a.base),
        ("frombuffer_of_base", lambda a: np.frombuffer(_base(a), dtype=np.uint8)),
    ]
    return [pytest.param(f, id=name) for name, f in makers]


class TestBufferPool:
    SHAPE = (64,)
    HUGE_SHAPE = (HUGE_BYTES // 4,)  # float32

    def _pool(self, **kwargs: int) -> BufferPool:
        return BufferPool(min_bytes=0, **kwargs)

    def test_take_gives_a_writeable_contiguous_buffer(self) -> None:
        """take returns a writeable C-contiguous array of the asked shape and dtype."""
        buf = self._pool().take((3, 5), "int32")
        assert buf.shape == (3, 5)
        assert buf.dtype == np.int32
        assert buf.flags.writeable
        assert buf.flags.c_contiguous

    def test_an_int_shape_means_one_dimension(self) -> None:
        """take(7, ...) is take((7,), ...)."""
        assert self._pool().take(7, np.float64).shape == (7,)

    @pytest.mark.parametrize("shape", [SHAPE, HUGE_SHAPE], ids=["small", "huge"])
    def test_free_buffer_is_reused(self, shape: tuple[int, ...]) -> None:
        """Once the result is dropped, the next take of that key hands out its memory again."""
        pool = self._pool()
        result = pool.publish(pool.take(shape, np.float32))
        address = _address(result)
        del result
        again = pool.take(shape, np.float32)
        assert _address(again) == address
        assert pool.statistics().reused == 1

    @pytest.mark.parametrize("shape", [SHAPE, HUGE_SHAPE], ids=["small", "huge"])
    def test_a_dropped_result_stays_dropped_when_its_memory_is_reused(
        self, shape: tuple[int, ...]
    ) -> None:
        """A weak reference to a dropped result is dead, as for any array, and stays dead when
        the pool hands the memory out again: every take gives a new array."""
        pool = self._pool()
        result = pool.publish(pool.take(shape, np.float32))
        address = _address(result)
        dropped = weakref.ref(result)
        del result
        assert dropped() is None
        again = pool.take(shape, np.float32)
        assert (_address(again), dropped()) == (address, None)

    def test_held_result_is_never_handed_out(self) -> None:
        """While a result is alive, take returns another buffer and the result keeps its data."""
        pool = self._pool()
        first = pool.take(self.SHAPE, np.float32)
        first[:] = 1.0
        result = pool.publish(first)
        del first
        second = pool.take(self.SHAPE, np.float32)
        assert second is not result
        assert not np.shares_memory(second, result)
        second[:] = 2.0
        assert (result == 1.0).all()

    @pytest.mark.parametrize("shape", [SHAPE, HUGE_SHAPE], ids=["small", "huge"])
    @pytest.mark.parametrize("make_view", _view_makers())
    def test_a_view_keeps_the_buffer_busy(
        self, make_view: Callable[[npt.NDArray[Any]], object], shape: tuple[int, ...]
    ) -> None:
        """A view (or container) of a dropped result, its ``.base`` or an array over that
        keeps the buffer from being reused until it is dropped too, whether ``np.empty`` made
        the buffer or a mapping of its own (huge, where ``.base`` is the mapping)."""
        pool = self._pool()
        first = pool.take(shape, np.float32)
        first[:] = 1.0
        address = _address(first)
        view = make_view(pool.publish(first))
        del first
        gc.collect()
        held = np.asarray(view).tobytes()
        other = pool.take(shape, np.float32)
        assert _address(other) != address
        other[:] = 2.0
        assert np.asarray(view).tobytes() == held
        del view, other
        assert _address(pool.take(shape, np.float32)) == address

    def test_a_reference_in_another_thread_keeps_the_buffer_busy(self) -> None:
        """A worker thread holding the buffer keeps it busy until it lets go."""
        pool = self._pool()
        out = pool.take(self.SHAPE, np.float32)
        address = _address(out)
        holding, release = threading.Event(), threading.Event()

        def hold(buffer: npt.NDArray[Any]) -> None:
            holding.set()
            release.wait(10)

        worker = threading.Thread(target=hold, args=(out,))
        worker.start()
        del out
        assert holding.wait(10)
        assert _address(pool.take(self.SHAPE, np.float32)) != address
        release.set()
        worker.join()
        assert _address(pool.take(self.SHAPE, np.float32)) == address

    def test_published_buffer_is_read_only(self) -> None:
        """publish returns the same array, read-only, and views of it are read-only too."""
        pool = self._pool()
        buf = pool.take(self.SHAPE, np.float32)
        result = pool.publish(buf)
        assert result is buf
        assert not result.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            result[0] = 1.0
        view = result[1:]
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 1.0

    def test_reused_buffer_is_writeable_again(self) -> None:
        """A published buffer handed out again is writeable."""
        pool = self._pool()
        pool.publish(pool.take(self.SHAPE, np.float32))
        again = pool.take(self.SHAPE, np.float32)
        assert pool.statistics().reused == 1
        assert again.flags.writeable
        again[:] = 3.0

    def test_at_most_per_key_buffers_are_kept(self) -> None:
        """With every buffer held, new ones are allocated but only per_key are pooled."""
        pool = self._pool(per_key=2)
        held = [pool.publish(pool.take(self.SHAPE, np.float32)) for _ in range(4)]
        addresses = [_address(h) for h in held]
        assert len(set(addresses)) == 4
        stats = pool.statistics()
        assert (stats.pooled_buffers, stats.allocated, stats.reused) == (2, 4, 0)
        owners = [weakref.ref(h.base) for h in held]
        del held
        # The pooled ones stay; the others are simply freed.
        assert [owner() is None for owner in owners] == [False, False, True, True]
        got = [pool.take(self.SHAPE, np.float32) for _ in range(2)]
        assert {_address(g) for g in got} == set(addresses[:2])

    def test_keys_are_shape_and_dtype(self) -> None:
        """A free buffer is only reused for the same shape and dtype."""
        pool = self._pool()
        pool.take(self.SHAPE, np.float32)
        assert pool.take(self.SHAPE, np.int32).dtype == np.int32
        assert pool.take((8, 8), np.float32).shape == (8, 8)
        assert pool.statistics().reused == 0
        pool.take(self.SHAPE, "float32")
        assert pool.statistics().reused == 1

    def test_total_pooled_bytes_stay_within_max_bytes(self) -> None:
        """Held buffers beyond max_bytes are allocated but not pooled."""
        nbytes = 64 * 4
        pool = self._pool(max_bytes=2 * nbytes)
        held = [pool.take((64,), np.float32), pool.take((64,), np.int32)]
        held.append(pool.take((64,), np.uint32))
        stats = pool.statistics()
        assert (stats.pooled_buffers, stats.pooled_bytes) == (2, 2 * nbytes)
        assert len(held) == 3

    def test_free_buffers_of_the_least_recently_used_key_make_room(self) -> None:
        """Over max_bytes, a free buffer of the oldest key is dropped for the new key."""
        nbytes = 64 * 4
        pool = self._pool(max_bytes=2 * nbytes)
        old = weakref.ref(pool.take((64,), np.float32).base)
        recent = pool.take((64,), np.int32)
        newest = pool.take((64,), np.uint32)
        assert old() is None  # dropped from the pool, and nothing else held it
        stats = pool.statistics()
        assert (stats.pooled_buffers, stats.pooled_bytes) == (2, 2 * nbytes)
        del newest
        assert pool.take((64,), np.uint32).dtype == np.uint32
        assert pool.statistics().reused == 1
        assert recent.dtype == np.int32

    def test_buffers_under_min_bytes_are_not_pooled(self) -> None:
        """Small buffers are allocated fresh every time."""
        pool = BufferPool(min_bytes=1024)
        pool.take((255,), np.float32)
        pool.take((255,), np.float32)
        stats = pool.statistics()
        assert (stats.pooled_buffers, stats.allocated, stats.reused) == (0, 2, 0)
        pool.take((256,), np.float32)
        assert pool.statistics().pooled_buffers == 1

    def test_buffer_over_max_bytes_is_not_pooled(self) -> None:
        """A buffer larger than max_bytes is allocated and never kept."""
        pool = self._pool(max_bytes=100)
        assert pool.take((26,), np.float32).shape == (26,)
        assert pool.statistics().pooled_buffers == 0

    def test_empty_and_zero_dimensional_buffers(self) -> None:
        """Shapes () and (0,) work and are reused like any other."""
        pool = self._pool()
        assert pool.take((), np.float64).shape == ()
        assert pool.take((0,), np.float64).shape == (0,)
        pool.take((), np.float64)
        pool.take((0,), np.float64)
        assert pool.statistics().reused == 2

    def test_pool_makes_no_reference_cycles(self) -> None:
        """A dropped result is freed by reference counting alone once the pool lets go."""
        pool = self._pool()
        gc.disable()
        try:
            result = pool.publish(pool.take(self.SHAPE, np.float32))
            owner = weakref.ref(result.base)
            pool.take(self.SHAPE, np.float32)  # a second buffer while the first is held
            pool.clear()
            del result
            assert owner() is None
        finally:
            gc.enable()

    def test_clear_forgets_pooled_buffers(self) -> None:
        """clear empties the pool; buffers still held stay intact."""
        pool = self._pool()
        held = pool.publish(pool.take(self.SHAPE, np.float32))
        pool.clear()
        assert pool.statistics().pooled_bytes == 0
        assert not np.shares_memory(pool.take(self.SHAPE, np.float32), held)
        assert not held.flags.writeable

    def test_statistics_count_takes(self) -> None:
        """taken = reused + allocated."""
        pool = self._pool()
        for _ in range(3):
            pool.take(self.SHAPE, np.float32)
        stats = pool.statistics()
        assert (stats.taken, stats.reused, stats.allocated) == (3, 2, 1)

    def test_negative_dimension_is_refused(self) -> None:
        """A negative dimension raises ValueError quoting the shape."""
        with pytest.raises(ValueError, match=r"shape \(2, -1\)"):
            self._pool().take((2, -1), np.float32)

    @pytest.mark.parametrize(
        "kwargs", [{"per_key": 0}, {"max_bytes": -1}, {"min_bytes": -1}], ids=str
    )
    def test_bad_bounds_are_refused(self, kwargs: dict[str, int]) -> None:
        """per_key < 1 or a negative byte bound raises ValueError."""
        with pytest.raises(ValueError, match="BufferPool needs per_key >= 1"):
            BufferPool(**kwargs)

    def test_publish_refuses_non_arrays(self) -> None:
        """publish of something that is not an ndarray raises TypeError."""
        bad: Any = [1, 2]
        with pytest.raises(TypeError, match=r"publish takes a numpy\.ndarray, got list"):
            self._pool().publish(bad)

    def test_reduce_into_pooled_buffers_over_steps(self) -> None:
        """Step after step, results held by the caller are never overwritten."""
        pool = self._pool()
        kept = []
        for step in range(5):
            inputs = [np.full(self.SHAPE, step + i, np.float32) for i in range(3)]
            out = pool.take(self.SHAPE, np.float32)
            reduce_range("sum", inputs, out, 0, out.size)
            result = pool.publish(out)
            del out
            if step % 2 == 0:
                kept.append((3 * step + 3, result))
            del result
        for want, result in kept:
            assert (result == want).all()


#: Every (op, dtype) the engine lets through to the backend: a mean of floating or complex
#: values, no order on complex ones.
_REDUCIBLE = [
    (op, dtype)
    for op in ("sum", "mean", "max", "min", "prod")
    for dtype in (np.float32, np.float64, np.complex128, np.int32, np.bool_)
    if not (op == "mean" and np.dtype(dtype).kind not in "fc")
    and not (op in ("max", "min") and np.dtype(dtype).kind == "c")
]


class TestReduceSmall:
    @pytest.mark.parametrize(("op", "dtype"), _REDUCIBLE)
    @pytest.mark.parametrize("n", [1, 2, 5])
    def test_the_same_bits_as_reduce_range(self, op: str, dtype: Any, n: int) -> None:
        """reduce_small, the backend's unchecked path for small work, gives exactly what
        reduce_range gives (the same ufuncs in the same order)."""
        rng = np.random.default_rng(n)
        inputs = [(rng.random(1000) * 4).astype(dtype) for _ in range(n)]
        checked = np.empty(1000, dtype)
        reduce_range(op, inputs, checked, 0, 1000)
        unchecked = np.empty(1000, dtype)
        _hostreduce.reduce_small(op, inputs, unchecked)
        assert unchecked.tobytes() == checked.tobytes()
