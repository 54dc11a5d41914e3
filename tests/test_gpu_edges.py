"""Edges of the GPU path, on the CuPy stand-in (``tests/cupy_sim``, two simulated GPUs): a
replica's own stream or device across its awaits, empty views, host data in collectives and
CuPy arrays from another GPU as ``run()`` arguments.

Every test runs with the race detector on: an access to device memory that CUDA would not
order fails it (``tests/simulated_gpus.py``). The values are checked too.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import anyio
import numpy as np
import pytest

import aioreplica

pytestmark = pytest.mark.anyio


def _context() -> aioreplica.ReplicaContext:
    ctx = aioreplica.get_replica_context()
    assert ctx is not None
    return ctx


def _state(cp: Any) -> tuple[int, Any]:
    return cp.cuda.runtime.getDevice(), cp.cuda.get_current_stream()


# -- a replica's own stream and device across its awaits ------------------------------------


class TestReplicaStateAcrossAwaits:
    async def test_with_side_stream_block_stays_current_across_an_await(self, cp: Any) -> None:
        """Work after an await inside the replica's ``with side:`` goes on ``side``: an event
        recorded there orders a consumer after it; after the block the replica's stream is
        current again, and the loop thread has its own state back after the run."""
        strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])
        devices: Any = strategy.extended.replica_devices
        events: list[tuple[int, str, bool]] = []

        async def step() -> Any:
            ctx = _context()
            replica = ctx.replica_id_in_sync_group
            side, consumer = cp.cuda.Stream(), cp.cuda.Stream()
            with side:
                events.append((replica, "before", cp.cuda.get_current_stream() == side))
                await anyio.lowlevel.checkpoint()
                events.append((replica, "after", cp.cuda.get_current_stream() == side))
                made = cp.arange(4.0) * (replica + 1)
                done = side.record()
            own = cp.cuda.get_current_stream() == devices[replica].stream
            events.append((replica, "own stream after the block", own))
            consumer.wait_event(done)
            with consumer:
                result = made + 1
            consumer.synchronize()
            return result

        before = _state(cp)
        results = strategy.experimental_local_results(await strategy.run(step))
        assert [r.get().tolist() for r in results] == [[1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 5.0, 7.0]]
        assert sorted(events) == [
            (replica, what, True)
            for replica in (0, 1)
            for what in ("after", "before", "own stream after the block")
        ]
        assert _state(cp) == before

    async def test_other_replicas_and_the_caller_never_see_a_side_stream(self, cp: Any) -> None:
        """While replica 0 waits inside its ``with side:`` on GPU 0, replica 1 runs on its
        own GPU and stream, and a ``with`` block of the caller's on GPU 0 ends on the caller's
        stream."""
        strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])
        devices: Any = strategy.extended.replica_devices
        seen: list[tuple[str, bool]] = []
        waiting = anyio.Event()
        resume = anyio.Event()

        async def step() -> None:
            replica = _context().replica_id_in_sync_group
            if replica == 0:
                with cp.cuda.Stream():
                    waiting.set()
                    await resume.wait()
            else:
                await waiting.wait()
                seen.append(("replica 1 on its stream", _state(cp) == (1, devices[1].stream)))

        async def caller() -> None:
            await waiting.wait()
            outside = cp.cuda.get_current_stream()
            with cp.cuda.Stream():
                pass
            seen.append(("caller's stream back", cp.cuda.get_current_stream() == outside))
            resume.set()

        async with anyio.create_task_group() as group:
            group.start_soon(caller)
            await strategy.run(step)
        assert sorted(seen) == [("caller's stream back", True), ("replica 1 on its stream", True)]

    async def test_merge_function_works_on_the_device_streams(self, cp: Any) -> None:
        """A merge function that writes a variable runs on the devices' own streams, although
        it runs in the task of a replica that waits inside its ``with side:`` block."""
        strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])
        with strategy.scope():
            total = aioreplica.Variable(
                np.zeros(3), synchronization="on_read", aggregation="sum", name="total"
            )

        async def merge(strategy: aioreplica.MirroredStrategy) -> None:
            await total.assign(np.full(3, 6.0))  # split over the copies, on each GPU

        async def step() -> Any:
            with cp.cuda.Stream():
                await _context().merge_call(merge)
            return total.value() * 1

        results = strategy.experimental_local_results(await strategy.run(step))
        assert [r.get().tolist() for r in results] == [[3.0] * 3] * 2
        assert total.numpy().tolist() == [6.0] * 3

    async def test_with_device_block_stays_current_across_an_await(self, cp: Any) -> None:
        """Arrays made after an await inside ``with cupy.cuda.Device(k):`` land on GPU k, and
        after the block the replica's GPU is current again."""
        strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])

        async def step() -> tuple[int, ...]:
            ctx = _context()
            if ctx.replica_id_in_sync_group == 1:
                await anyio.lowlevel.checkpoint()
                return -1, -1, cp.cuda.runtime.getDevice()
            with cp.cuda.Device(1):
                before = cp.ones(2)
                await anyio.lowlevel.checkpoint()
                after = cp.ones(2)
            return before.device.id, after.device.id, cp.cuda.runtime.getDevice()

        results = strategy.experimental_local_results(await strategy.run(step))
        assert list(results) == [(1, 1, 0), (-1, -1, 1)]


# -- empty views --------------------------------------------------------------------------


class TestEmptyViews:
    def test_empty_slice_of_another_gpus_array_is_a_view_there(self, cp: Any) -> None:
        """As CuPy's ``_view_getitem``: ``a[2:2]`` is a view on ``a``'s GPU, with no kernel,
        whichever GPU is current."""
        with cp.cuda.Device(1):
            a = cp.arange(4.0)
        world = cp._sim.world()
        world.kernels.clear()
        with cp.cuda.Device(0):
            empty = a[2:2]
        assert (empty.device.id, empty.shape, world.kernels) == (1, (0,), [])

    async def test_packed_all_reduce_with_empty_leaves_stays_on_each_gpu(self, cp: Any) -> None:
        """A packed all_reduce of empty leaves gives each replica its results on its own GPU,
        and the next collective is ordered after it."""
        strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])

        async def step(shape: tuple[int, ...]) -> Any:
            ctx = _context()
            xp = ctx.device.xp
            leaves = [xp.ones(shape, np.float32), xp.ones(shape, np.float32)]
            return await ctx.all_reduce("sum", leaves)

        empty = strategy.experimental_local_results(await strategy.run(step, ((0,),)))
        full = strategy.experimental_local_results(await strategy.run(step, ((2,),)))
        assert [[leaf.device.id for leaf in leaves] for leaves in empty] == [[0, 0], [1, 1]]
        assert [[leaf.get().tolist() for leaf in leaves] for leaves in full] == [
            [[2.0, 2.0], [2.0, 2.0]]
        ] * 2


# -- host data in GPU collectives ------------------------------------------------------------


class TestHostDataInCollectives:
    async def test_numpy_arrays_all_reduce_onto_each_replicas_gpu(self, cp: Any) -> None:
        """NumPy arrays (0-d too) go where scalars go: onto each replica's GPU."""
        strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])

        async def step() -> Any:
            replica = _context().replica_id_in_sync_group
            value = [np.array(float(replica)), np.full(2, replica + 1.0, np.float32)]
            return await _context().all_reduce("sum", value)

        results = strategy.experimental_local_results(await strategy.run(step))
        assert [
            [(type(r).__module__, r.device.id, r.get().tolist()) for r in result]
            for result in results
        ] == [[("cupy", gpu, 1.0), ("cupy", gpu, [3.0, 3.0])] for gpu in (0, 1)]

    async def test_values_from_function_of_numpy_arrays_reduce_and_gather(self, cp: Any) -> None:
        """``experimental_distribute_values_from_function`` returning NumPy arrays, then
        ``strategy.reduce`` and ``strategy.gather``, as on host replicas."""
        strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: np.full(2, ctx.replica_id_in_sync_group + 1.0, np.float32)
        )
        total = await strategy.reduce("sum", values, axis=None)
        gathered = await strategy.gather(values, axis=0)
        assert (total.get().tolist(), gathered.get().tolist()) == (
            [3.0, 3.0],
            [1.0, 1.0, 2.0, 2.0],
        )


# -- run() arguments on another GPU ----------------------------------------------------------


class TestRunArguments:
    async def test_cupy_argument_on_another_gpu_is_copied_to_each_replica(self, cp: Any) -> None:
        """A CuPy array made on GPU 0 before the step reaches replica 1 on GPU 1, read after
        it was written (no peer access, no race), one copy for each use of the same array;
        replica 0 gets the array itself."""
        strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])
        with cp.cuda.Device(0):
            x = cp.asarray(np.arange(4.0))

        async def step(x: Any, *, scale: Any) -> Any:
            return x.device.id, x is scale, x * 2

        results = strategy.experimental_local_results(
            await strategy.run(step, args=(x,), kwargs={"scale": x})
        )
        assert [(gpu, same, y.get().tolist()) for gpu, same, y in results] == [
            (0, True, [0.0, 2.0, 4.0, 6.0]),
            (1, True, [0.0, 2.0, 4.0, 6.0]),
        ]

    async def test_per_replica_component_on_the_wrong_gpu_is_moved(self, cp: Any) -> None:
        """``PerReplica`` components made on the other replica's GPU are placed on their
        replica's."""
        strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])
        inputs = []
        for gpu in (1, 0):
            with cp.cuda.Device(gpu):
                inputs.append(cp.full(2, float(gpu)))

        async def step(x: Any) -> Any:
            return x.device.id, x + 1

        results = strategy.experimental_local_results(
            await strategy.run(step, args=(aioreplica.PerReplica(inputs),))
        )
        assert [(gpu, y.get().tolist()) for gpu, y in results] == [
            (0, [2.0, 2.0]),
            (1, [1.0, 1.0]),
        ]


# -- input on GPUs -----------------------------------------------------------------------------


class TestGpuInput:
    async def test_a_replica_past_its_datasets_end_gets_zero_rows_with_no_host_sync(
        self, cp: Any
    ) -> None:
        """A PER_REPLICA dataset of GPU batches that ends first: its replica gets zero-row
        batches on its GPU shaped like the last one, made with no copy of that batch to the
        host, so nothing on the loop's thread waits for a GPU (``cupyx.allow_synchronize(False)``
        around the pass refuses any ``get()`` that copies)."""
        import cupyx

        strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])

        def dataset_fn(context: aioreplica.InputContext) -> list[Any]:
            r = context.input_pipeline_id
            with cp.cuda.Device(r):
                return [cp.full((2, 3), 10 * r + i, cp.float32) for i in range(2 if r else 1)]

        options = aioreplica.InputOptions(experimental_replication_mode="per_replica")
        with contextlib.ExitStack() as disallowed:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # allow_synchronize warns that it is deprecated
                disallowed.enter_context(cupyx.allow_synchronize(False))
            elements = [
                strategy.experimental_local_results(element)
                async for element in strategy.distribute_datasets_from_function(dataset_fn, options)
            ]
        got = [[(type(p).__module__, p.shape, p.dtype.name) for p in e] for e in elements]
        assert got == [
            [("cupy", (2, 3), "float32"), ("cupy", (2, 3), "float32")],
            [("cupy", (0, 3), "float32"), ("cupy", (2, 3), "float32")],
        ]
