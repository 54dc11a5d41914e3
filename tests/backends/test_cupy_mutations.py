"""The CuPy backend's ordering steps, each taken out in turn: the stand-in's race detector must
catch the operation that relies on it, and the same operation must pass with the step in.

Each test runs twice: ``intact`` (the backend as it is: no race) and ``mutated`` (one event,
wait or stream flag of ``aioreplica._backends._cupy`` monkeypatched away: ``RaceError``). A
mutated run takes its race out of the machine's record afterwards, so the fixtures that fail a
test on an unreported race stay quiet.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import aioreplica

if TYPE_CHECKING:
    from collections.abc import Iterator

MUTATED = pytest.mark.parametrize("mutated", [False, True], ids=["intact", "mutated"])


@contextlib.contextmanager
def races_if(mutated: bool, cp: Any, match: str) -> Iterator[None]:
    """Expect a ``RaceError`` whose message starts with ``match`` (a pattern) in the block if
    ``mutated``, then forget it; expect no race otherwise."""
    from cupy._sim import RaceError

    if not mutated:
        yield
        return
    with pytest.raises(RaceError, match=rf"^data race on device memory: {match}") as excinfo:
        yield
    world = cp._sim.world()
    assert world.races == [str(excinfo.value)]
    world.races.clear()


@pytest.mark.anyio
@MUTATED
async def test_fan_in_orders_the_leader_after_the_other_replicas(
    cp: Any, cb: Any, monkeypatch: pytest.MonkeyPatch, mutated: bool
) -> None:
    """Two replicas on GPU 0, each with its own stream: the leader's stream reads the other
    replica's input only after ``fan_in`` made it wait for that replica's stream."""
    if mutated:
        monkeypatch.setattr(cb._Plan, "fan_in", lambda self: None)
    devices = [cb.CudaDevice(0), cb.CudaDevice(0)]
    inputs = [devices[0].asarray(np.ones(4)), devices[1].asarray(np.full(4, 2.0))]
    with races_if(mutated, cp, r"read by add \(\S*aioreplica/_backends/_cupy\.py:\d+ \w+\)"):
        results = await cb.CUPY_BACKEND.all_reduce("sum", inputs, devices)
    if not mutated:
        for result in results:
            np.testing.assert_array_equal(result.get(), np.full(4, 3.0))


@pytest.mark.anyio
@MUTATED
@pytest.mark.parametrize("rounds", [1, 2])
async def test_fan_out_back_edge_keeps_the_pool_from_reusing_a_result_too_early(
    cp: Any, cb: Any, monkeypatch: pytest.MonkeyPatch, mutated: bool, rounds: int
) -> None:
    """Two replicas on GPU 0, each round new inputs and results dropped. The other replica's
    stream reads the leader's result (its copy); without the leader's stream waiting for that
    read, the next round's input on the leader's stream gets the result's block from the pool
    while the read is unordered. One round reuses nothing; two are the smallest loop that
    races."""
    fan_out = cb._Plan.fan_out
    dropped: list[Any] = []

    def fan_out_without_back_edge(plan: Any, outputs: list[Any]) -> list[Any]:
        """``fan_out`` with every ``leader.wait_event`` in it (the back edges) dropped."""
        leaders = [group.leader for group in plan.groups if group.others]
        for leader in leaders:
            leader.wait_event = dropped.append
        try:
            return fan_out(plan, outputs)  # type: ignore[no-any-return]
        finally:
            for leader in leaders:
                del leader.wait_event

    if mutated:
        monkeypatch.setattr(cb._Plan, "fan_out", fan_out_without_back_edge)
    devices = [cb.CudaDevice(0), cb.CudaDevice(0)]
    hosts = [np.ones(64), np.full(64, 2.0)]
    with races_if(
        mutated and rounds == 2,
        cp,
        r"write by host-to-device copy .* on stream 1 .* not ordered after the read by copy "
        r"\(\S*aioreplica/_backends/_cupy\.py:\d+ \w+\) on stream 2 ",
    ):
        for _ in range(rounds):
            inputs = [device.asarray(host) for device, host in zip(devices, hosts, strict=True)]
            await cb.CUPY_BACKEND.all_reduce("sum", inputs, devices)
    assert len(dropped) == (1 if mutated else 0)  # a second round races before its fan-out


@pytest.mark.anyio
@MUTATED
async def test_blocking_streams_order_a_result_read_outside_the_step(
    cp: Any, cb: Any, monkeypatch: pytest.MonkeyPatch, mutated: bool
) -> None:
    """A step's result is read with ``float()`` outside the step, on the default stream: it is
    ordered after the replica's stream only because that stream is a blocking one."""
    if mutated:
        stream = cp.cuda.Stream

        def non_blocking(null: bool = False, non_blocking: bool = False, ptds: bool = False) -> Any:
            return stream(null=null, non_blocking=True, ptds=ptds)

        with monkeypatch.context() as patch:
            patch.setattr(cp.cuda, "Stream", non_blocking)
            devices = [cb.cuda_device(0), cb.cuda_device(1)]
    else:
        devices = [cb.cuda_device(0), cb.cuda_device(1)]
    assert [d.stream.is_non_blocking for d in devices] == [mutated, mutated]
    strategy = aioreplica.MirroredStrategy(devices)

    async def step() -> Any:
        context = aioreplica.get_replica_context()
        assert context is not None
        return context.device.xp.sum(context.device.asarray([1.0, 2.0]))

    result = await strategy.run(step)
    first, second = result.values
    with races_if(
        mutated,
        cp,
        r"read by device-to-host copy \(get\) \(\S*tests/backends/test_cupy_mutations\.py:\d+ "
        r"test_blocking_streams_order_a_result_read_outside_the_step\) on the default stream "
        r"of GPU 0 is not ordered after the write by sum ",
    ):
        assert (float(first), float(second)) == (3.0, 3.0)


@MUTATED
def test_asarray_waits_for_the_source_gpus_stream(
    cp: Any, cb: Any, monkeypatch: pytest.MonkeyPatch, mutated: bool
) -> None:
    """An array made on GPU 1's default stream, adopted by a device of GPU 0: the copy on the
    device's stream must wait for the source GPU's current stream."""
    device = cb.CudaDevice(0)
    if mutated:
        monkeypatch.setattr(device.stream, "wait_event", lambda event: None)
    with cp.cuda.Device(1):
        source = cp.arange(4.0)
    with races_if(
        mutated,
        cp,
        r"read by copy between devices \(\S*aioreplica/_backends/_cupy\.py:\d+ \w+\) on "
        r"stream 1 \(blocking\) of GPU 0 is not ordered after the write by arange .* on the "
        r"default stream of GPU 1$",
    ):
        adopted = device.asarray(source)
    if not mutated:
        assert adopted.device.id == 0
        np.testing.assert_array_equal(adopted.get(), [0.0, 1.0, 2.0, 3.0])
