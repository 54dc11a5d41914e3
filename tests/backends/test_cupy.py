"""Tests for aioreplica._backends._cupy: CUDA devices and the CuPy collectives backend.

Everything but ``TestImportBoundary`` runs on the CuPy stand-in (``tests/cupy_sim``) with 1, 2
and 4 simulated GPUs; ``test_cupy_gpu.py`` runs the same classes on the real CuPy where it sees
a CUDA device (and is skipped with one line elsewhere). ``devices/check_gpu.py`` checks the same
backend through the public API on real hardware.
"""

from __future__ import annotations

import contextlib
import functools
import json
import subprocess
import sys
import textwrap
import threading
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from simulated_gpus import simulated_cupy

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path
    from types import ModuleType

OPS = ("sum", "mean", "max", "min", "prod")


class TestImportBoundary:
    def test_import_aioreplica_imports_neither_cupy_nor_the_cuda_backend(
        self, tmp_path: Path
    ) -> None:
        """``import aioreplica`` loads neither ``cupy`` nor ``aioreplica._backends._cupy``.

        An importable stand-in ``cupy`` package sits first on the path, so the test means
        the same with or without a real CuPy installed.
        """
        (tmp_path / "cupy").mkdir()
        (tmp_path / "cupy" / "__init__.py").write_text("")
        code = textwrap.dedent(
            f"""
            import json, sys
            sys.path.insert(0, {str(tmp_path)!r})
            import aioreplica, aioreplica._backends
            watched = ["cupy", "aioreplica._backends._cupy"]
            print(json.dumps([name for name in watched if name in sys.modules]))
            """
        )
        completed = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=20
        )
        assert (completed.returncode, completed.stderr) == (0, "")
        assert json.loads(completed.stdout) == []


# -- everything below runs on the stand-in here, and on a real GPU in test_cupy_gpu.py ------


@pytest.fixture(scope="module", params=[1, 2, 4], ids=["sim-1gpu", "sim-2gpu", "sim-4gpu"])
def cb(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The ``_cupy`` backend module on the stand-in with ``request.param`` GPUs, where any
    unordered access fails the test. ``test_cupy_gpu.py`` runs the same tests on a real GPU."""
    with simulated_cupy(request.param):
        from aioreplica._backends import _cupy

        yield _cupy


@pytest.fixture
def cp(cb: Any) -> Any:
    """The ``cupy`` module (after ``cb`` has checked that a GPU is there)."""
    import cupy

    return cupy


def _state(cp: Any) -> tuple[int, Any]:
    return cp.cuda.runtime.getDevice(), cp.cuda.get_current_stream()


def _layouts(cb: Any) -> dict[str, list[Any]]:
    """Replica layouts for 1 and 2 replicas: two GPUs if there are two, else one GPU twice."""
    first = cb.cuda_device(0)
    layouts = {"1 replica": [first], "2 replicas, 1 GPU": [first, cb.CudaDevice(0)]}
    if _two_gpus_with_nccl(cb):
        layouts["2 replicas, 2 GPUs"] = [first, cb.cuda_device(1)]
    return layouts


def _two_gpus_with_nccl(cb: Any) -> bool:
    """Whether collectives across two GPUs can run here (CuPy's wheels come without NCCL)."""
    return bool(cb.visible_device_count() >= 2 and cb._nccl_or_none() is not None)


def _host_inputs(op: str, count: int, dtype: str) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(7)
    if np.dtype(dtype).kind in "iu":
        return [rng.integers(-3, 4, size=(9, 5)).astype(dtype) for _ in range(count)]
    low, high = (0.5, 1.5) if op == "prod" else (-2.0, 2.0)
    return [rng.uniform(low, high, size=(9, 5)).astype(dtype) for _ in range(count)]


def _numpy_reduce(op: str, hosts: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    if op == "mean":
        return np.asarray(np.mean(np.stack(hosts), axis=0))
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
    return np.asarray(functools.reduce(ufunc, hosts))


def _to_devices(devices: list[Any], hosts: list[np.ndarray[Any, Any]]) -> list[Any]:
    return [device.asarray(host) for device, host in zip(devices, hosts, strict=True)]


@pytest.mark.gpu
class TestCudaDevice:
    def test_names_kind_and_index(self, cb: Any, cp: Any) -> None:
        """``gpu:<i>``, kind ``gpu``, a context to enter, CuPy as its array module."""
        device = cb.cuda_device(0)
        assert (device.name, device.kind, device.index, device.has_context) == (
            "gpu:0",
            "gpu",
            0,
            True,
        )
        assert device.xp is cp
        assert device.backend is cb.CUPY_BACKEND
        assert cb.cuda_device(0) is device

    def test_owns_a_blocking_stream_on_its_gpu(self, cb: Any) -> None:
        """The device's stream was created on its GPU and is ordered with the legacy default
        stream, on which code outside a step reads and makes arrays."""
        stream = cb.cuda_device(0).stream
        assert (stream.device_id, stream.is_non_blocking) == (0, False)

    def test_enter_makes_device_and_stream_current_and_leave_restores(
        self, cb: Any, cp: Any
    ) -> None:
        """After ``leave`` the device and the ``use()``'d stream from before are current."""
        device = cb.cuda_device(0)
        before_device = cp.cuda.runtime.getDevice()
        other = cp.cuda.Stream(non_blocking=True)
        previous = cp.cuda.get_current_stream()
        other.use()
        try:
            device.enter()
            inside = _state(cp)
            device.leave()
            assert inside == (0, device.stream)
            assert _state(cp) == (before_device, other)
        finally:
            previous.use()

    def test_leave_restores_the_stream_of_an_enclosing_with_block(self, cb: Any, cp: Any) -> None:
        """Entered inside ``with stream:``, ``leave`` makes that stream current again."""
        device = cb.cuda_device(0)
        outer = cp.cuda.Stream(non_blocking=True)
        with cp.cuda.Device(0), outer:
            device.enter()
            device.leave()
            assert _state(cp) == (0, outer)

    def test_with_block_inside_a_step_falls_back_to_the_device_stream(
        self, cb: Any, cp: Any
    ) -> None:
        """Replica code's own ``with other_stream:`` ends on the replica's stream."""
        device = cb.cuda_device(0)
        device.enter()
        try:
            with cp.cuda.Stream(non_blocking=True):
                pass
            assert _state(cp) == (0, device.stream)
        finally:
            device.leave()

    def test_leave_restores_the_device_when_the_step_switched_it(self, cb: Any, cp: Any) -> None:
        """A step that switched device and did not switch back still leaves cleanly."""
        device = cb.cuda_device(0)
        before = _state(cp)
        device.enter()
        cp.cuda.runtime.setDevice(cb.visible_device_count() - 1)
        device.leave()
        assert _state(cp) == before

    def test_asarray_places_host_data_on_the_device(self, cb: Any, cp: Any) -> None:
        """Host data becomes a CuPy array on the device; one already there is returned as is."""
        device = cb.cuda_device(0)
        array = device.asarray(np.arange(6.0).reshape(2, 3))
        assert isinstance(array, cp.ndarray)
        assert array.device.id == 0
        assert device.asarray(array) is array
        np.testing.assert_array_equal(array.get(), np.arange(6.0).reshape(2, 3))

    @pytest.mark.anyio
    async def test_synchronize_waits_for_queued_work(self, cb: Any, cp: Any) -> None:
        """After ``await synchronize()`` everything queued on the stream before has finished.
        (The stream itself may still be busy for a moment with the callback that woke the
        wait: CUDA's callback holds the stream until it returns.)"""
        device = cb.cuda_device(0)
        x = device.asarray(np.ones((1024, 1024), dtype=np.float32))
        results = [await device.run(cp.matmul, x, x) for _ in range(8)]
        with cp.cuda.Device(0):
            queued = device.stream.record()
        await device.synchronize()
        assert queued.done
        assert results[-1].get()[0, 0] == 1024.0

    @pytest.mark.anyio
    async def test_run_calls_fn_with_device_and_stream_current(self, cb: Any, cp: Any) -> None:
        """``run`` runs its function inline with the device and its stream current."""
        device = cb.cuda_device(0)
        before = _state(cp)
        seen = await device.run(_state, cp)
        assert seen == (0, device.stream)
        assert _state(cp) == before


@pytest.mark.gpu
class TestCupyBackend:
    def test_cupy_arrays_are_told_apart(self, cb: Any, cp: Any) -> None:
        """CuPy arrays are arrays of kind ``cupy``; NumPy arrays and lists are not."""
        from aioreplica._backends import array_kind, is_cupy_array

        assert (is_cupy_array(cp.zeros(2)), array_kind(cp.zeros(2))) == (True, "cupy")
        assert not is_cupy_array(np.zeros(2))
        assert not is_cupy_array([0.0])

    @pytest.mark.anyio
    @pytest.mark.parametrize("op", OPS)
    @pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
    async def test_all_reduce_matches_numpy(self, cb: Any, op: str, dtype: str) -> None:
        """Every op on 1 and 2 replicas gives each replica NumPy's answer, on its GPU."""
        for layout, devices in _layouts(cb).items():
            hosts = _host_inputs(op, len(devices), dtype)
            results = await cb.CUPY_BACKEND.all_reduce(op, _to_devices(devices, hosts), devices)
            expected = _numpy_reduce(op, hosts)
            assert [r.device.id for r in results] == [d.index for d in devices], layout
            for result in results:
                got = result.get()
                assert got.dtype == expected.dtype, layout
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=layout)

    @pytest.mark.anyio
    async def test_mean_of_bools_and_small_ints_is_summed_in_float64(self, cb: Any) -> None:
        """The mean of bool and int8 inputs is NumPy's float64 mean on every layout, also
        where a GPU holds several replicas (their sum is not taken in the input's dtype)."""
        for layout, devices in _layouts(cb).items():
            for hosts in (
                [np.array([True, True, False])] * len(devices),
                [np.array([100, -100, 7], dtype=np.int8)] * len(devices),
            ):
                results = await cb.CUPY_BACKEND.all_reduce(
                    "mean", _to_devices(devices, hosts), devices
                )
                expected = np.mean(np.stack(hosts), axis=0)
                got = [(r.get().dtype, r.get().tolist()) for r in results]
                assert got == [(expected.dtype, expected.tolist())] * len(devices), layout

    @pytest.mark.anyio
    async def test_every_replica_gets_its_own_result(self, cb: Any) -> None:
        """Results do not alias each other or the inputs, so a replica may change its own."""
        devices = _layouts(cb)["2 replicas, 1 GPU"]
        inputs = _to_devices(devices, _host_inputs("sum", 2, "float32"))
        results = await cb.CUPY_BACKEND.all_reduce("sum", inputs, devices)
        pointers = {a.data.ptr for a in [*inputs, *results]}
        assert len(pointers) == 4

    @pytest.mark.anyio
    async def test_all_gather_concatenates_uneven_inputs_in_replica_order(self, cb: Any) -> None:
        """Inputs of different lengths along the axis are concatenated in replica order."""
        for layout, devices in _layouts(cb).items():
            hosts = [np.full((i + 1, 3), i, dtype=np.int16) for i in range(len(devices))]
            for axis in (0, 1):
                shaped = [h if axis == 0 else np.ascontiguousarray(h.T) for h in hosts]
                results = await cb.CUPY_BACKEND.all_gather(
                    _to_devices(devices, shaped), axis, devices
                )
                expected = np.concatenate(shaped, axis=axis)
                for result in results:
                    np.testing.assert_array_equal(result.get(), expected, err_msg=layout)

    @pytest.mark.anyio
    async def test_broadcast_copies_the_value_to_every_replica(self, cb: Any) -> None:
        """Each replica gets the value on its own GPU, in an array of its own."""
        for layout, devices in _layouts(cb).items():
            value = devices[-1].asarray(np.arange(12.0).reshape(3, 4))
            results = await cb.CUPY_BACKEND.broadcast(value, devices)
            assert [r.device.id for r in results] == [d.index for d in devices], layout
            for result in results:
                assert result.data.ptr != value.data.ptr
                np.testing.assert_array_equal(result.get(), np.arange(12.0).reshape(3, 4))

    @pytest.mark.anyio
    async def test_all_reduce_packed_joins_any_layout_per_replica(self, cb: Any) -> None:
        """Leaves of any layout (a transposed one too) come back reduced, end to end."""
        for layout, devices in _layouts(cb).items():
            hosts = [np.arange(6.0).reshape(2, 3) * (r + 1) for r in range(len(devices))]
            leaves = [
                [d.asarray(h).T for d, h in zip(devices, hosts, strict=True)],
                [d.asarray(h[0]) for d, h in zip(devices, hosts, strict=True)],
            ]
            results = await cb.CUPY_BACKEND.all_reduce_packed("sum", leaves, devices)
            total = np.sum(hosts, axis=0)
            expected = np.concatenate([total.T.ravel(), total[0]])
            assert [r.device.id for r in results] == [d.index for d in devices], layout
            for result in results:
                np.testing.assert_array_equal(result.get(), expected, err_msg=layout)

    @pytest.mark.parametrize("op", ["sum", "mean"])
    def test_reduce_to_first_reduces_onto_the_first_gpu(self, cb: Any, op: str) -> None:
        """The copies' sum or mean, in a new array on the first replica's GPU."""
        for layout, devices in _layouts(cb).items():
            hosts = [np.full(3, float(r + 1)) for r in range(len(devices))]
            inputs = _to_devices(devices, hosts)
            total = cb.CUPY_BACKEND.reduce_to_first(op, inputs, devices)
            expected = sum(hosts) / (len(hosts) if op == "mean" else 1)
            assert total.device.id == devices[0].index, layout
            assert all(total.data.ptr != x.data.ptr for x in inputs), layout
            np.testing.assert_array_equal(total.get(), expected, err_msg=layout)

    def test_reduce_to_first_refuses_other_ops(self, cb: Any) -> None:
        """Only sum and mean: a variable's read has no other aggregation."""
        device = cb.cuda_device(0)
        with pytest.raises(ValueError, match=r"'sum' or 'mean', not 'max'"):
            cb.CUPY_BACKEND.reduce_to_first("max", [device.asarray([1.0])], [device])

    @pytest.mark.anyio
    async def test_unknown_op_raises_value_error_naming_it(self, cb: Any) -> None:
        """An op that is not a reduction is named in the error with the valid ones."""
        device = cb.cuda_device(0)
        with pytest.raises(ValueError, match=r"^unknown reduction 'median'; expected one of "):
            await cb.CUPY_BACKEND.all_reduce("median", [device.asarray([1.0])], [device])

    @pytest.mark.anyio
    async def test_host_device_is_rejected_with_type_error(self, cb: Any) -> None:
        """A host device among the devices is a ``TypeError`` naming it and its replica."""
        from aioreplica._backends import HostDevice

        with pytest.raises(TypeError, match=r"GPU devices.*HostDevice.*replica 1$"):
            await cb.CUPY_BACKEND.all_reduce(
                "sum", [np.zeros(1), np.zeros(1)], [cb.cuda_device(0), HostDevice(0)]
            )

    @pytest.mark.anyio
    async def test_dtype_nccl_cannot_reduce_is_a_type_error_across_gpus(self, cb: Any) -> None:
        """int16 has no NCCL type: across GPUs that is a ``TypeError`` saying what to cast to."""
        if not _two_gpus_with_nccl(cb):
            pytest.skip("needs two GPUs and NCCL")
        devices = [cb.cuda_device(0), cb.cuda_device(1)]
        inputs = _to_devices(devices, [np.ones(3, dtype=np.int16)] * 2)
        with pytest.raises(TypeError, match=r"cannot reduce dtype int16.*astype\('int32'\)"):
            await cb.CUPY_BACKEND.all_reduce("sum", inputs, devices)

    @pytest.mark.anyio
    async def test_to_host_copies_after_the_streams_work_without_a_host_sync(
        self, cb: Any, cp: Any
    ) -> None:
        """A new, writeable, C-contiguous NumPy array holding the value that the work queued
        on the device's stream made (a transposed one, a 0-d one, an empty one), made with no
        host synchronization (none is declared under ``cupyx.allow_synchronize(False)``)."""
        import cupyx

        device = cb.cuda_device(0)
        hosts: list[np.ndarray[Any, Any]] = [
            np.arange(12.0, dtype=np.float32).reshape(3, 4),
            np.array(2.5),
            np.zeros((0, 3)),
        ]
        for host in hosts:
            value = device.asarray(host)
            doubled = await device.run(lambda v=value: (v * 2).T)  # queued on the stream
            with contextlib.ExitStack() as disallowed:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # allow_synchronize warns it is deprecated
                    disallowed.enter_context(cupyx.allow_synchronize(False))
                got = await cb.CUPY_BACKEND.to_host(doubled, device)
            assert type(got) is np.ndarray
            assert (got.shape, got.dtype) == (host.shape[::-1], host.dtype)
            assert got.flags.c_contiguous
            assert got.flags.writeable
            np.testing.assert_array_equal(got, (host * 2).T)

    @pytest.mark.anyio
    async def test_to_host_of_another_gpus_array_or_host_data(self, cb: Any, cp: Any) -> None:
        """An array on another GPU is copied (through ``device``'s GPU); host data is copied."""
        device = cb.cuda_device(0)
        if cb.visible_device_count() >= 2:
            other = cb.cuda_device(1).asarray(np.arange(5, dtype=np.int64))
            got = await cb.CUPY_BACKEND.to_host(other, device)
            np.testing.assert_array_equal(got, np.arange(5))
        source = np.arange(4)[::-1]
        got = await cb.CUPY_BACKEND.to_host(source, device)
        np.testing.assert_array_equal(got, [3, 2, 1, 0])
        assert got.flags.c_contiguous
        assert not np.shares_memory(got, source)

    @pytest.mark.anyio
    async def test_to_host_refuses_a_host_device(self, cb: Any, cp: Any) -> None:
        from aioreplica._backends import HostDevice

        with pytest.raises(TypeError, match=r"GPU devices.*HostDevice"):
            await cb.CUPY_BACKEND.to_host(cb.cuda_device(0).asarray([1.0]), HostDevice(0))

    @pytest.mark.anyio
    async def test_to_host_abandoned_keeps_its_buffer_until_the_copy_is_done(
        self, cb: Any, cp: Any
    ) -> None:
        """A cancelled wait leaves the copy running on the GPU: its buffer must not go back to
        the pinned pool before the copy ends, so it is kept until a later call finds it
        done."""
        import anyio

        device = cb.cuda_device(0)
        value = device.asarray(np.ones(64, np.float32))
        cb._abandoned_copies.clear()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await cb.CUPY_BACKEND.to_host(value, device)
        [(event, buffer)] = cb._abandoned_copies
        assert buffer.shape == (64,)
        sim = getattr(cp, "_sim", None)
        if sim is not None:  # the copy still runs (the GPU answers "not yet"): kept
            sim.world().busy_queries = 1
            cb._forget_finished_copies()
            assert cb._abandoned_copies == [(event, buffer)]
        await device.synchronize()
        assert event.done
        await cb.CUPY_BACKEND.to_host(value, device)
        assert cb._abandoned_copies == []

    @pytest.mark.anyio
    async def test_to_host_without_page_locked_memory_copies_in_a_thread(
        self, cb: Any, cp: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """No page-locked memory left (CUDA's out-of-memory from ``cupyx.empty_pinned``):
        the copy goes into ordinary memory, in a worker thread, after the stream's work. While
        the thread copies, the loop's other tasks see their own device and stream current, not
        the copying device's."""
        import anyio
        import cupyx

        def exhausted(*args: Any, **kwargs: Any) -> Any:
            raise cp.cuda.runtime.CUDARuntimeError(2)  # cudaErrorMemoryAllocation

        copying, copied = threading.Event(), threading.Event()
        host_array = cb.host_array

        def held_copy(array: Any, owner: Any) -> Any:
            copying.set()
            assert copied.wait(10)
            return host_array(array, owner)

        device = cb.cuda_device(cb.visible_device_count() - 1)
        value = await device.run(lambda: device.asarray(np.arange(6.0)).reshape(2, 3).T * 2)
        monkeypatch.setattr(cupyx, "empty_pinned", exhausted)
        monkeypatch.setattr(cb, "host_array", held_copy)
        before = _state(cp)
        seen: list[tuple[int, Any]] = []
        got: list[Any] = []

        async def copy() -> None:
            got.append(await cb.CUPY_BACKEND.to_host(value, device))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(copy)
            await anyio.to_thread.run_sync(copying.wait, 10.0)
            seen.append(_state(cp))  # the loop's state while the thread copies
            copied.set()
        assert seen == [before]
        assert _state(cp) == before
        np.testing.assert_array_equal(got[0], np.arange(6.0).reshape(2, 3).T * 2)
        assert got[0].flags.c_contiguous

    def test_visible_device_count_counts_the_gpus(self, cb: Any, cp: Any) -> None:
        """The count is CuPy's device count."""
        assert cb.visible_device_count() == cp.cuda.runtime.getDeviceCount()


@pytest.mark.anyio
@pytest.mark.parametrize("gpus", [2, 4])
async def test_broadcast_of_a_value_on_a_gpu_without_a_replica_waits_for_its_gpu(
    gpus: int,
) -> None:
    """A value made outside a step on a GPU that holds no replica (there is one only with two
    GPUs or more) is read after the work queued on that GPU's current stream, and that stream
    waits for the read: the stand-in reports no race."""
    with simulated_cupy(gpus) as cp:
        from aioreplica._backends import _cupy as cb

        devices = [cb.cuda_device(0)]
        with cp.cuda.Device(gpus - 1):
            value = cp.asarray(np.arange(6.0).reshape(2, 3)).T  # non-contiguous too
        results = await cb.CUPY_BACKEND.broadcast(value, devices)
        assert [(r.device.id, r.get().tolist()) for r in results] == [
            (0, np.arange(6.0).reshape(2, 3).T.tolist())
        ]
        with cp.cuda.Device(gpus - 1):
            value += 1  # reuses nothing early: the write is ordered after the read


def test_docstring_examples_run_on_the_stand_in() -> None:
    """The CUDA backend's docstring examples pass on two simulated GPUs (``--doctest-modules``
    does not collect them; ``test_cupy_gpu.py`` runs them on a real GPU)."""
    with simulated_cupy(2):
        from aioreplica._backends import _cupy

        assert_docstring_examples_pass(_cupy)


def assert_docstring_examples_pass(cupy_backend: ModuleType) -> None:
    """Run the docstring examples of ``cupy_backend`` (``aioreplica._backends._cupy``, on
    whichever CuPy it was imported with) and check that they all pass."""
    import doctest

    import anyio

    import aioreplica

    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    globs = {"np": np, "anyio": anyio, "aioreplica": aioreplica}
    tests = [t for t in finder.find(cupy_backend, extraglobs=globs) if t.examples]
    for test in tests:
        runner.run(test)
    outcome = runner.summarize(verbose=False)
    assert len(tests) >= 8
    assert (outcome.failed, outcome.attempted > 20) == (0, True)
