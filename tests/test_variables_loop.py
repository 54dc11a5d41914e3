"""Variables and the event loop: whole-array work of writes, updates and slots runs on the
devices' threads (invariant 4), and arguments of ``extended.update`` go to each copy's device."""

from __future__ import annotations

import re
import threading
import tracemalloc
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from aioreplica import MirroredStrategy, PerReplica, Variable
from aioreplica.optimizers import Adam
from aioreplica.testing import FakeDevice, replica_context

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]


def fake_strategy() -> MirroredStrategy:
    """Two replicas on fake devices, whose work always goes to their worker threads."""
    return MirroredStrategy([FakeDevice(f"fake:{i}", i) for i in range(2)])


def recording(
    monkeypatch: pytest.MonkeyPatch, name: str, on_loop: list[bool]
) -> Callable[..., Any]:
    """Replace NumPy's function ``name`` by one that notes in ``on_loop``, for each call,
    whether it ran on the calling (event loop's) thread."""
    loop = threading.get_ident()
    original = getattr(np, name)

    def noted(*args: Any, **kwargs: Any) -> Any:
        on_loop.append(threading.get_ident() == loop)
        return original(*args, **kwargs)

    monkeypatch.setattr(np, name, noted)
    return noted


def assert_off_the_loop(on_loop: list[bool]) -> None:
    """Every call ``recording`` noted ran off the event loop's thread (and there were some)."""
    assert len(on_loop) > 0
    assert on_loop == [False] * len(on_loop)


class TestWritesWithoutAggregation:
    async def test_the_same_value_is_compared_on_the_device_threads(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Whether the replicas wrote the same value to a variable without aggregation is
        decided on the devices' threads, not on the event loop's."""
        strategy = fake_strategy()
        with strategy.scope():
            v = Variable(np.zeros(4), name="v")
        on_loop: list[bool] = []
        recording(monkeypatch, "array_equal", on_loop)

        async def step() -> None:
            await v.assign(np.arange(4.0))

        await strategy.run(step)
        assert_off_the_loop(on_loop)
        assert [copy.tolist() for copy in v.values] == [[0.0, 1.0, 2.0, 3.0]] * 2

    async def test_different_values_are_compared_on_the_device_threads(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A write of different values is refused, naming the replica, after comparisons
        made on the devices' threads; nothing changes."""
        strategy = fake_strategy()
        with strategy.scope():
            v = Variable(np.zeros(4), name="v")
        on_loop: list[bool] = []
        recording(monkeypatch, "array_equal", on_loop)

        async def step(value: Array) -> None:
            await v.assign(value)

        values = PerReplica([np.zeros(4), np.ones(4)])
        with pytest.raises(ValueError, match=r"replica 1 passed another than replica 0's"):
            await strategy.run(step, args=(values,))
        assert_off_the_loop(on_loop)
        assert [copy.tolist() for copy in v.values] == [[0.0] * 4] * 2

    async def test_refusing_a_big_array_costs_no_more_memory_than_writing_it(self) -> None:
        """The message of a refused write shows the first value's corners without a list of
        all its elements: it takes no more memory than a write that succeeds."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        size = 1 << 20
        with strategy.scope():
            v = Variable(np.zeros(size), name="big")

        async def step(value: Array) -> None:
            await v.assign(value)

        peaks: list[float] = []
        for second in (np.ones(size), np.full(size, 2.0)):
            values = PerReplica([np.ones(size), second])
            tracemalloc.start()
            if second[0] == 1.0:
                await strategy.run(step, args=(values,))
            else:
                with pytest.raises(
                    ValueError, match=re.escape("replica 0's [1., 1., ..., 1., 1.])")
                ):
                    await strategy.run(step, args=(values,))
            peaks.append(tracemalloc.get_traced_memory()[1] / (8 * size))
            tracemalloc.stop()
        written, refused = peaks
        assert refused < written + 1.0, f"peaks, in array sizes: {peaks}"

    async def test_a_short_value_is_shown_whole(self) -> None:
        """A refused value whose elements fit in a short list is shown as that list."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            v = Variable(np.zeros(3, np.int64), name="counts")

        async def step(value: Array) -> None:
            await v.assign(value)

        values = PerReplica([np.array([1, 2, 3]), np.array([1, 2, 4])])
        with pytest.raises(
            ValueError, match=r"replica 1 passed another than replica 0's \[1, 2, 3\]"
        ):
            await strategy.run(step, args=(values,))


class TestUpdateArguments:
    async def test_equal_components_are_compared_on_the_device_threads(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``extended.update`` checks that a ``PerReplica`` argument of a mirrored variable
        holds equal components on the devices' threads."""
        strategy = fake_strategy()
        with strategy.scope():
            v = Variable(np.zeros(3), name="v")
        on_loop: list[bool] = []
        recording(monkeypatch, "array_equal", on_loop)
        step = PerReplica([np.ones(3), np.ones(3)])
        await strategy.extended.update(v, np.add, (step,))
        assert_off_the_loop(on_loop)
        assert [copy.tolist() for copy in v.values] == [[1.0, 1.0, 1.0]] * 2

    async def test_host_arrays_are_placed_on_each_gpu(self, cp: Any) -> None:
        """A NumPy argument reaches each GPU copy's ``fn`` on that copy's GPU, in cross-replica
        and in replica context, as TF runs ``fn`` under the copy's device."""
        strategy = MirroredStrategy(["gpu:0", "gpu:1"])
        with strategy.scope():
            w = Variable(np.ones(3, np.float32), name="w")
        seen: list[int] = []

        def add(copy: Any, x: Any) -> Any:
            seen.append(x.device.id)
            return copy + x

        await strategy.extended.update(w, add, (np.ones(3, np.float32),))

        async def step() -> None:
            await strategy.extended.update(w, add, (np.ones(3, np.float32),))

        await strategy.run(step)
        assert seen == [0, 1, 0, 1]
        assert [copy.get().tolist() for copy in w.values] == [[3.0, 3.0, 3.0]] * 2

    async def test_an_array_of_one_gpu_is_copied_to_the_other_in_order(self, cp: Any) -> None:
        """A CuPy argument made on gpu:0 reaches gpu:1's copy through an ordered copy (the
        stand-in fails a read of it that is not ordered after its making)."""
        strategy = MirroredStrategy(["gpu:0", "gpu:1"])
        with strategy.scope():
            w = Variable(np.ones(3, np.float32), name="w")
        with cp.cuda.Device(0):
            five = cp.full(3, 5.0, np.float32)
        await strategy.extended.update(w, lambda copy, x: copy + x, (five,))
        assert [copy.get().tolist() for copy in w.values] == [[6.0, 6.0, 6.0]] * 2
        assert [copy.device.id for copy in w.values] == [0, 1]

    async def test_an_array_passed_twice_stays_one_array(self, cp: Any) -> None:
        """An array passed twice reaches each GPU copy's ``fn`` as one array, copied once, as
        ``run()`` passes it to a replica: a NumPy one and one of another GPU alike."""
        strategy = MirroredStrategy(["gpu:0", "gpu:1"])
        with strategy.scope():
            w = Variable(np.ones(3, np.float32), name="w")
        with cp.cuda.Device(0):
            five = cp.full(3, 5.0, np.float32)
        host = np.ones(3, np.float32)
        seen: list[tuple[int, bool, bool]] = []

        def add(copy: Any, x: Any, y: Any, z: Any, *, again: Any) -> Any:
            seen.append((x.device.id, x is y, z is again))
            return copy + x + y + z + again

        await strategy.extended.update(w, add, (host, host, five), {"again": five})
        assert seen == [(0, True, True), (1, True, True)]
        assert [copy.get().tolist() for copy in w.values] == [[13.0, 13.0, 13.0]] * 2

    async def test_a_cupy_argument_of_a_host_strategy_is_left_alone(self, cp: Any) -> None:
        """On host devices a CuPy argument reaches ``fn`` as it is: it is not copied to the
        host on the event loop's thread, which would block the loop until its GPU is done."""
        import cupyx

        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            w = Variable(np.ones(3), name="w")
        with cp.cuda.Device(0):
            five = cp.full(3, 5.0)
        seen: list[str] = []

        def add(copy: Any, x: Any) -> Any:
            seen.append(type(x).__module__.split(".")[0])
            return copy + 1

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # allow_synchronize is deprecated
            with cupyx.allow_synchronize(False):
                await strategy.extended.update(w, add, (five,))
        assert seen == ["cupy"]  # once: host copies of a mirrored variable share one array
        assert [copy.tolist() for copy in w.values] == [[2.0, 2.0, 2.0]] * 2

    async def test_cupy_components_for_a_host_strategy_are_compared_off_the_loop(
        self, cp: Any
    ) -> None:
        """A PerReplica of equal CuPy arrays for a host variable: the check that its values
        are equal waits for the GPU on a worker thread, not on the event loop's; unequal
        ones are refused, and nothing is written."""
        import cupyx

        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            w = Variable(np.ones(3), name="w")
        with cp.cuda.Device(0):
            equal = PerReplica([cp.full(3, 5.0), cp.full(3, 5.0)])
            unequal = PerReplica([cp.full(3, 5.0), cp.full(3, 6.0)])

        def add(copy: Any, x: Any) -> Any:
            return copy + 1

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # allow_synchronize is deprecated
            with cupyx.allow_synchronize(False):
                await strategy.extended.update(w, add, (equal,))
                with pytest.raises(TypeError, match="values differ between replicas"):
                    await strategy.extended.update(w, add, (unequal,))
        assert [copy.tolist() for copy in w.values] == [[2.0, 2.0, 2.0]] * 2


class TestOnGpus:
    @pytest.mark.parametrize(("aggregation", "dtype"), [("none", np.float32), ("mean", np.int64)])
    async def test_a_write_of_one_value_syncs_no_host_on_the_loop(
        self, cp: Any, aggregation: str, dtype: Any
    ) -> None:
        """A replica-context write that must check every replica passed the same value
        (no aggregation; an integer mean) waits for the GPUs without a host sync on the event
        loop's thread."""
        import cupyx

        strategy = MirroredStrategy(["gpu:0", "gpu:1"])
        with strategy.scope():
            v = Variable(np.zeros(3, dtype), name="v", aggregation=aggregation)

        async def step() -> None:
            value = replica_context().device.xp.full(3, 3, dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # allow_synchronize is deprecated
                with cupyx.allow_synchronize(False):
                    await v.assign(value)

        await strategy.run(step)
        assert [copy.get().tolist() for copy in v.values] == [[3, 3, 3]] * 2

    async def test_different_values_are_refused_without_a_host_sync_on_the_loop(
        self, cp: Any
    ) -> None:
        """A refused write of different values makes its message without a host sync on the
        event loop's thread."""
        import cupyx

        strategy = MirroredStrategy(["gpu:0", "gpu:1"])
        with strategy.scope():
            v = Variable(np.zeros(20, np.float32), name="v")

        async def step() -> None:
            ctx = replica_context()
            value = ctx.device.xp.full(20, ctx.replica_id_in_sync_group, np.float32)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # allow_synchronize is deprecated
                with cupyx.allow_synchronize(False):
                    await v.assign(value)

        with pytest.raises(
            ValueError,
            match=r"replica 1 passed another than replica 0's \[0\., 0\., \.\.\., 0\., 0\.\]",
        ):
            await strategy.run(step)


class TestOptimizerSlots:
    async def test_a_first_step_fills_its_slots_on_the_device_threads(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An optimizer's first step fills its new slots on the devices' threads."""
        strategy = fake_strategy()
        with strategy.scope():
            w = Variable(np.ones(3), name="w")
        opt = Adam(0.1)
        on_loop: list[bool] = []
        recording(monkeypatch, "full", on_loop)

        async def step() -> None:
            await opt.apply_gradients([(np.ones(3), w)])

        await strategy.run(step)
        assert_off_the_loop(on_loop)
        slots = [slot.numpy().round(9).tolist() for slot in opt.variables()]
        assert slots == [[0.2] * 3, [0.004] * 3]  # m and v after a summed gradient of twos
