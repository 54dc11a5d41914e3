"""Stream ordering of the CUDA backend, on the CuPy stand-in: each test is a defect of the GPU
path that a real GPU would turn into wrong numbers, a hang or an error, written as a user
meets it.

Every test runs on ``tests/cupy_sim`` (see ``tests/simulated_gpus.py``), where an access to
device memory that CUDA would not order raises ``RaceError``; the values are checked too.
"""

from __future__ import annotations

import copy
import gc
import warnings
from typing import Any

import anyio
import numpy as np
import pytest
from simulated_gpus import simulated_cupy

import aioreplica

pytestmark = pytest.mark.anyio


def _state(cp: Any) -> tuple[int, Any]:
    return cp.cuda.runtime.getDevice(), cp.cuda.get_current_stream()


# -- 1. host reads and user arrays are ordered with the replica streams -------------------


async def test_float_of_a_result_read_outside_the_step(cp: Any) -> None:
    """``float(loss)`` after ``run()``: the host copy waits for the replica's stream."""
    strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])

    async def step() -> Any:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        x = ctx.device.asarray(np.arange(4.0) + ctx.replica_id_in_sync_group)
        return (x * x).sum()

    losses = await strategy.run(step)
    assert [float(loss) for loss in strategy.experimental_local_results(losses)] == [14.0, 30.0]
    assert float(await strategy.reduce("sum", losses)) == 44.0


async def test_variable_host_reads_after_a_step_wrote_it(cp: Any) -> None:
    """``numpy()``, ``float``, ``int``, ``bool``, ``np.asarray`` and ``repr`` of a variable
    that replicas just wrote on their streams read the written value."""
    strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])
    with strategy.scope():
        v = aioreplica.Variable(1.0, aggregation="mean")
        total = aioreplica.Variable(0.0, synchronization="on_read", aggregation="sum")

    async def step() -> None:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        await total.assign_add(ctx.device.asarray(2.0 + ctx.replica_id_in_sync_group))
        await v.assign(ctx.device.asarray(3.5))

    await strategy.run(step)
    assert (v.numpy().item(), float(v), int(v), bool(v)) == (3.5, 3.5, 3, True)
    assert np.asarray(v).item() == 3.5
    assert "value=array(3.5)" in repr(v)
    assert (total.numpy().item(), float(total)) == (5.0, 5.0)


async def test_host_device_asarray_of_a_gpu_result(cp: Any) -> None:
    """A host device adopting a CuPy result copies it after the work that made it."""
    from aioreplica._backends import HostDevice

    strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])

    async def step() -> Any:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        return ctx.device.asarray(np.full(3, 1.0)) * (ctx.replica_id_in_sync_group + 2)

    results = strategy.experimental_local_results(await strategy.run(step))
    hosts = [HostDevice(0).asarray(result) for result in results]
    assert [h.tolist() for h in hosts] == [[2.0] * 3, [3.0] * 3]


async def test_arrays_made_outside_a_step_are_ordered_before_it(cp: Any) -> None:
    """``PerReplica`` arguments, ``assign`` values and initial values made with ``cp`` outside
    a step (on the default stream, on either GPU) are read after they are written."""
    strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])
    with cp.cuda.Device(1):
        initial = cp.asarray(np.arange(3.0))  # on GPU 1, made on its default stream
    with strategy.scope():
        v = aioreplica.Variable(initial)
    assert [copy.device.id for copy in v.values] == [0, 1]
    with cp.cuda.Device(1):
        new = cp.asarray(np.full(3, 7.0))
    await v.assign(new)
    inputs = []
    for gpu in (0, 1):
        with cp.cuda.Device(gpu):
            inputs.append(cp.asarray(np.full(3, float(gpu + 1))))

    async def step(x: Any) -> Any:
        return x + v.value()

    results = strategy.experimental_local_results(
        await strategy.run(step, (aioreplica.PerReplica(inputs),))
    )
    assert [r.get().tolist() for r in results] == [[8.0] * 3, [9.0] * 3]
    assert [r.device.id for r in results] == [0, 1]


# -- 2. cross-replica math runs on the owning device and stream ----------------------------


async def test_non_contiguous_leaves_are_reduced_on_their_own_gpus(cp: Any) -> None:
    """A transposed (``.T``) and a strided leaf packed with small ones: each replica's result
    is right and on its GPU; no kernel reads another GPU's array."""
    strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])
    hosts = [np.arange(12.0).reshape(3, 4) * (r + 1) for r in range(2)]

    async def step() -> Any:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        x = ctx.device.asarray(hosts[ctx.replica_id_in_sync_group])
        return await ctx.all_reduce("sum", {"t": x.T, "s": x[:, ::2], "b": x[0]})

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kernel on a peer GPU's array warns
        results = await strategy.run(step)
    total = hosts[0] + hosts[1]
    for key, expected in (("t", total.T), ("s", total[:, ::2]), ("b", total[0])):
        leaves = strategy.experimental_local_results(results[key])
        assert [leaf.get().tolist() for leaf in leaves] == [expected.tolist()] * 2
        assert [leaf.device.id for leaf in leaves] == [0, 1]


async def test_cross_replica_assign_of_a_sync_on_read_sum_splits_on_each_gpu(cp: Any) -> None:
    """``assign`` in cross-replica context splits the total over the copies, each on its GPU."""
    strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])
    with strategy.scope():
        v = aioreplica.Variable(0.0, synchronization="on_read", aggregation="sum")
    await v.assign(cp.asarray(8.0))
    assert [copy.device.id for copy in v.values] == [0, 1]
    assert [copy.get().item() for copy in v.values] == [4.0, 4.0]
    assert float(v) == 8.0


async def test_zero_d_values_keep_their_shape_across_gpus(cp: Any) -> None:
    """A 0-d leaf reduced or broadcast across GPUs stays 0-d (CuPy's ``ascontiguousarray``
    makes it 1-d)."""
    strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])

    async def step() -> Any:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        x = ctx.device.asarray(np.ones(4, np.float32))
        reduced = await ctx.all_reduce("sum", {"x": x, "scalar": 1.5})
        sent = await ctx.broadcast(ctx.device.asarray(2.0 + ctx.replica_id_in_sync_group))
        return reduced["scalar"], sent

    scalars, sent = await strategy.run(step)
    for value, expected in ((scalars, 3.0), (sent, 2.0)):
        local = strategy.experimental_local_results(value)
        assert [(x.shape, x.get().item()) for x in local] == [((), expected)] * 2


# -- 3. cross-replica reads of a sync-on-read variable are ordered -------------------------


async def test_checkpoint_saves_the_sum_the_replicas_just_wrote(cp: Any, tmp_path: Any) -> None:
    """A checkpoint taken right after a step saves the new aggregate, not a stale one."""
    strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])
    with strategy.scope():
        seen = aioreplica.Variable(0, synchronization="on_read", aggregation="sum")

    async def step() -> None:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        await seen.assign_add(ctx.device.asarray(10 * (ctx.replica_id_in_sync_group + 1)))

    await strategy.run(step)
    path = await aioreplica.Checkpoint(seen=seen).save(tmp_path / "ckpt")
    await seen.assign(0)
    await aioreplica.Checkpoint(seen=seen).restore(path)
    assert int(seen) == 30


# -- 4. nested enter() keeps the loop thread's device state -------------------------------


def test_nested_enter_and_leave_restore_in_order(cp: Any, cb: Any) -> None:
    """``enter`` twice, ``leave`` twice: the state of before is back, not replica 0's."""
    device = cb.cuda_device(1)
    before = _state(cp)
    device.enter()
    device.enter()
    device.leave()
    assert _state(cp) == (1, device.stream)
    device.leave()
    assert _state(cp) == before


async def test_using_a_variable_inside_a_step_leaves_the_state_as_it_was(cp: Any) -> None:
    """``repr`` and ``copy.deepcopy`` of a variable inside a replica enter its devices again;
    afterwards the replica still runs on its own stream, and after the run the loop thread
    has its own device and default stream back."""
    strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])
    with strategy.scope():
        v = aioreplica.Variable(1.0, synchronization="on_read", aggregation="sum")
    seen: list[tuple[int, int, Any]] = []

    async def step() -> None:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        repr(v)
        copy.deepcopy(v)
        await anyio.lowlevel.checkpoint()
        seen.append((ctx.replica_id_in_sync_group, *_state(cp)))

    before = _state(cp)
    await strategy.run(step)
    devices: Any = strategy.extended.replica_devices
    assert sorted(seen, key=lambda s: s[0]) == [
        (0, 0, devices[0].stream),
        (1, 1, devices[1].stream),
    ]
    assert _state(cp) == before


# -- 5. synchronize() is bounded ----------------------------------------------------------


async def test_synchronize_returns_when_callbacks_are_lost(cp: Any, cb: Any) -> None:
    """A driver that never runs the stream callback costs polling, not a hang."""
    world = cp._sim.world()
    world.drop_callbacks = True
    world.busy_queries = 3  # the stream and the event answer "not yet" a few times
    device = cb.cuda_device(0)
    with anyio.fail_after(5):
        await device.synchronize()
    assert world.busy_queries == 0


async def test_synchronize_raises_the_device_error(cp: Any, cb: Any) -> None:
    """A failed kernel is a ``CUDARuntimeError`` from ``synchronize``, not an endless wait."""
    world = cp._sim.world()
    world.busy_queries = 1
    world.fail_status = 700
    with anyio.fail_after(5), pytest.raises(cp.cuda.runtime.CUDARuntimeError, match=r"700|illegal"):
        await cb.cuda_device(0).synchronize()
    world.fail_status = 0


# -- 6. a CuPy without NCCL --------------------------------------------------------------


async def test_without_nccl_a_collective_across_gpus_says_what_to_install() -> None:
    """No NCCL: building the strategy works and warns nothing; a collective across GPUs is a
    ``RuntimeError`` with the fix; CuPy's import warning does not escape."""
    with simulated_cupy(2, nccl=False):
        strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])

        async def step() -> Any:
            ctx = aioreplica.get_replica_context()
            assert ctx is not None
            return await ctx.all_reduce("sum", ctx.device.asarray([1.0]))

        with pytest.raises(RuntimeError, match=r"need NCCL.*nvidia-nccl-cu12"):
            await strategy.run(step)


# -- 7. NCCL communicators are made when the strategy is built ------------------------------


async def test_communicators_are_made_with_the_strategy_not_in_a_collective(
    cp: Any, cb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ncclCommInitAll`` runs once, in the constructor, not on the event loop mid-step."""
    from cupy.cuda import nccl

    calls: list[tuple[str, list[int]]] = []
    phase = ["building"]
    init_all = nccl.NcclCommunicator.initAll

    def counted(devices: list[int]) -> Any:
        calls.append((phase[0], devices))
        return init_all(devices)

    monkeypatch.setattr(nccl.NcclCommunicator, "initAll", staticmethod(counted))
    strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])
    phase[0] = "running"

    async def step() -> Any:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        return await ctx.all_reduce("sum", ctx.device.asarray([1.0, 2.0]))

    results = strategy.experimental_local_results(await strategy.run(step))
    assert [r.get().tolist() for r in results] == [[2.0, 4.0], [2.0, 4.0]]
    assert calls == [("building", [0, 1])]


# -- 8. no extra pass over the inputs -----------------------------------------------------


async def test_all_reduce_on_one_gpu_reads_each_input_once(cp: Any, cb: Any) -> None:
    """Four replicas on one GPU: three adds into the result, three copies out; no copy of
    the first input before the adds."""
    devices = [cb.cuda_device(0), *(cb.CudaDevice(0) for _ in range(3))]
    inputs = [d.asarray(np.full(5, float(i))) for i, d in enumerate(devices)]
    world = cp._sim.world()
    world.kernels.clear()
    results = await cb.CUPY_BACKEND.all_reduce("sum", inputs, devices)
    assert [name for name, _ in world.kernels] == ["add"] * 3 + ["copy"] * 3
    assert [r.get().tolist() for r in results] == [[6.0] * 5] * 4
    del results
    gc.collect()


async def test_reduce_to_an_array_means_its_device(cp: Any) -> None:
    """``reduce_to(op, value, destinations=array)``: a CuPy array's GPU; a host array means
    the host, which a GPU strategy does not hold: refused, saying so."""
    strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])

    async def step() -> Any:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        return ctx.device.asarray(np.full(2, 1.0 + ctx.replica_id_in_sync_group))

    value = await strategy.run(step)
    with cp.cuda.Device(1):
        on_gpu1 = cp.zeros(2)
    reduced = await strategy.extended.reduce_to("sum", value, on_gpu1)
    assert isinstance(reduced, cp.ndarray)
    assert reduced.device.id == 1
    np.testing.assert_array_equal(cp.asnumpy(reduced), [3.0, 3.0])
    with pytest.raises(ValueError, match=r"a host value \(on 'cpu:0'\) is not one of"):
        await strategy.extended.reduce_to("sum", value, np.zeros(2))


async def test_mean_of_integers_made_on_each_gpu(cp: Any) -> None:
    """strategy.reduce's float mean of integers converts each replica's array on its own
    GPU's stream, after the step that made it."""
    strategy = aioreplica.MirroredStrategy(["gpu:0", "gpu:1"])

    async def step() -> Any:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        return ctx.device.asarray(np.arange(3, dtype=np.int32) + ctx.replica_id_in_sync_group)

    rows = await strategy.run(step)
    summed = await strategy.reduce("sum", rows, axis=0)
    assert (float(summed), summed.dtype) == (9.0, np.dtype(np.int32))
    assert float(await strategy.reduce("mean", rows, axis=0)) == 1.5
    assert (await strategy.reduce("mean", rows)).get().tolist() == [0.5, 1.5, 2.5]
