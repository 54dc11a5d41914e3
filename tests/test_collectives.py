"""Collectives on host devices: replica-context and cross-replica, checks and packing."""

from __future__ import annotations

import contextvars
import re
import threading
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import aioreplica
from aioreplica import (
    CommunicationImplementation,
    CommunicationOptions,
    Mirrored,
    MirroredStrategy,
    PerReplica,
    ReduceOp,
    ReplicaSyncError,
    VariableAggregation,
)
from aioreplica._backends import HostDevice, _hostreduce, _numpy
from aioreplica._backends._numpy import INLINE_BYTES
from aioreplica.testing import StrategyFactory, host_devices, replica_context, replica_id

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

pytestmark = pytest.mark.anyio


def local(strategy: MirroredStrategy, value: Any) -> tuple[Any, ...]:
    return strategy.experimental_local_results(value)


NUMPY_REDUCE = {
    "sum": lambda a: np.sum(a, axis=0),
    "mean": lambda a: np.mean(a, axis=0),
    "max": lambda a: np.max(a, axis=0),
    "min": lambda a: np.min(a, axis=0),
    "prod": lambda a: np.prod(a, axis=0),
}


class TestReduceOp:
    def test_strings_and_members(self) -> None:
        """Names in any case and members parse; an unknown name lists the valid ones."""
        assert ReduceOp.parse("SUM") is ReduceOp.SUM
        assert ReduceOp.parse(ReduceOp.MEAN) is ReduceOp.MEAN
        with pytest.raises(ValueError, match="unknown reduce op 'avg': use a ReduceOp or one of"):
            ReduceOp.parse("avg")

    def test_from_variable_aggregation(self) -> None:
        """TF's mapping: SUM and MEAN have an op (members or names); the others raise."""
        assert ReduceOp.from_variable_aggregation(VariableAggregation.SUM) is ReduceOp.SUM
        assert ReduceOp.from_variable_aggregation("MEAN") is ReduceOp.MEAN
        for aggregation in [VariableAggregation.NONE, "only_first_replica", 3]:
            with pytest.raises(ValueError, match="only SUM and MEAN have one"):
                ReduceOp.from_variable_aggregation(aggregation)


class TestCommunicationOptions:
    def test_validation(self) -> None:
        """Negative pack sizes and negative timeouts are refused; 0 is TF's "no timeout"."""
        with pytest.raises(ValueError, match="bytes_per_pack must be an int >= 0"):
            CommunicationOptions(bytes_per_pack=-1)
        with pytest.raises(ValueError, match=r"timeout_seconds must be a number of seconds >= 0"):
            CommunicationOptions(timeout_seconds=-0.5)
        with pytest.raises(ValueError, match=r"\(0: no timeout\) or None, got nan"):
            CommunicationOptions(timeout_seconds=float("nan"))
        assert CommunicationOptions(timeout_seconds=0).timeout_seconds == 0.0

    @pytest.mark.parametrize("value", [float("inf"), 10**400], ids=["inf", "10**400"])
    def test_a_timeout_too_large_for_a_float(self, value: Any) -> None:
        """An infinite timeout, or an int too large for a float, is a ValueError saying that 0
        means no timeout (not an OverflowError, nor a timeout that never ends)."""
        shown = re.escape(f"got {value!r:.60}")
        with pytest.raises(
            ValueError,
            match=(
                rf"^timeout_seconds must be a number of seconds >= 0 \(0: no timeout\) or None, "
                rf"{shown}, which is infinite or too large: for no timeout pass 0$"
            ),
        ):
            CommunicationOptions(timeout_seconds=value)

    @pytest.mark.parametrize("value", [True, "1", None, 1.5])
    def test_a_pack_size_of_another_type(self, value: Any) -> None:
        """True is an int to Python, not a pack size: a TypeError, as for any value that is
        no integer."""
        shown = re.escape(f"got {type(value).__name__} {value!r}")
        packing = rf"^bytes_per_pack must be an int >= 0 \(0: automatic\), {shown}$"
        with pytest.raises(TypeError, match=packing):
            CommunicationOptions(bytes_per_pack=value)

    @pytest.mark.parametrize("value", [True, "1", [1]])
    def test_a_timeout_of_another_type(self, value: Any) -> None:
        """True is an int to Python, not a timeout: a TypeError, as for any value that is no
        number."""
        shown = re.escape(f"got {type(value).__name__} {value!r}")
        with pytest.raises(TypeError, match=rf"^timeout_seconds must .* or None, {shown}$"):
            CommunicationOptions(timeout_seconds=value)

    async def test_options_of_another_type_are_refused(self) -> None:
        """A collective's ``options`` that is no ``CommunicationOptions`` (a timeout in
        seconds, say) is a TypeError in every collective, and the strategy goes on."""
        strategy = MirroredStrategy(host_devices(2))
        x = np.ones(2)
        calls: dict[str, Callable[[Any], Awaitable[Any]]] = {
            "all_reduce": lambda bad: replica_context().all_reduce("sum", x, options=bad),
            "all_gather": lambda bad: replica_context().all_gather(x, options=bad),
            "broadcast": lambda bad: replica_context().broadcast(x, options=bad),
            "reduce_scatter": lambda bad: replica_context().reduce_scatter("sum", x, options=bad),
            "barrier": lambda bad: replica_context().barrier(options=bad),
        }
        shown = "options must be a CommunicationOptions or None, got int 5"
        for call in calls.values():
            with pytest.raises(TypeError, match=shown):
                await strategy.run(call, args=(5,))
            await strategy.run(call, args=(None,))  # the same call with good options
        pairs = [(PerReplica([x, x]), "cpu:0")]
        with pytest.raises(TypeError, match=shown):
            await strategy.extended.batch_reduce_to("sum", pairs, options=5)  # type: ignore[arg-type]
        assert (await strategy.extended.batch_reduce_to("sum", pairs))[0].tolist() == [2.0, 2.0]

    def test_call_options_override_strategy_options(self) -> None:
        """Fields a call sets win; the others keep the strategy's."""
        base = CommunicationOptions(bytes_per_pack=64, timeout_seconds=9.0)
        assert base.override(CommunicationOptions(timeout_seconds=1.0)) == CommunicationOptions(
            64, 1.0
        )
        assert base.override(None) is base
        ring = CommunicationOptions(implementation="ring")
        assert base.override(ring) == CommunicationOptions(
            64, 9.0, CommunicationImplementation.RING
        )
        assert ring.override(CommunicationOptions(timeout_seconds=1.0)) == CommunicationOptions(
            0, 1.0, "RING"
        )

    def test_implementation_takes_tfs_names(self) -> None:
        """``implementation`` is TF's hint under TF's names: members, or their names in any
        case, AUTO by default; anything else is refused with the valid names."""
        assert CommunicationOptions().implementation is CommunicationImplementation.AUTO
        for spelled in ("NCCL", "nccl", CommunicationImplementation.NCCL):
            chosen = CommunicationOptions(implementation=spelled).implementation
            assert chosen is CommunicationImplementation.NCCL
        assert (
            CommunicationOptions(0, None, "Ring").implementation is CommunicationImplementation.RING
        )
        valid = "use a CommunicationImplementation or one of 'auto', 'ring', 'nccl'"
        with pytest.raises(
            ValueError, match=f"unknown communication implementation 'mpi': {valid}"
        ):
            CommunicationOptions(implementation="mpi")
        with pytest.raises(ValueError, match=f"unknown communication implementation 2: {valid}"):
            CommunicationOptions(implementation=2)  # type: ignore[arg-type]

    @pytest.mark.parametrize("implementation", list(CommunicationImplementation))
    async def test_every_implementation_reduces_alike(
        self, implementation: CommunicationImplementation
    ) -> None:
        """TF programs that name an implementation run unchanged, for the strategy or for one
        call: on host devices every one combines with NumPy, as AUTO does."""
        options = CommunicationOptions(implementation=implementation)
        strategy = MirroredStrategy(host_devices(3), communication_options=options)
        data = PerReplica([np.arange(4.0) * (r + 1) for r in range(3)])

        async def step(x: np.ndarray[Any, Any]) -> tuple[Any, Any]:
            ctx = replica_context()
            return await ctx.all_reduce("sum", x), await ctx.all_gather(x, options=options)

        total, rows = await strategy.run(step, args=(data,))
        for got in local(strategy, total):
            assert got.tolist() == [0.0, 6.0, 12.0, 18.0]
        for got in local(strategy, rows):
            assert got.tolist() == np.concatenate(data.values).tolist()
        reduced = await strategy.extended.reduce_to("sum", data, "cpu:0", options=options)
        assert reduced.tolist() == [0.0, 6.0, 12.0, 18.0]


class TestAllReduce:
    @pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
    @pytest.mark.replicas(1, 2, 3)
    async def test_matches_numpy(
        self, op: str, strategy_factory: StrategyFactory, replicas: int
    ) -> None:
        """Every op equals NumPy's reduction over the replicas' values."""
        rng = np.random.default_rng(replicas)
        data = [rng.normal(size=(4, 5)) for _ in range(replicas)]
        strategy = strategy_factory()

        async def step(x: np.ndarray[Any, Any]) -> Any:
            return await replica_context().all_reduce(op, x)

        result = await strategy.run(step, args=(PerReplica(data),))
        for got in local(strategy, result):
            np.testing.assert_allclose(got, NUMPY_REDUCE[op](np.stack(data)), rtol=1e-12)

    async def test_result_shared_read_only(self) -> None:
        """Host replicas share one read-only result: no per-replica copies."""
        strategy = MirroredStrategy(host_devices(4))
        seen: list[np.ndarray[Any, Any]] = []

        async def step() -> None:
            result = await replica_context().all_reduce("sum", np.full(1000, float(replica_id())))
            seen.append(result)

        await strategy.run(step)
        assert all(r is seen[0] for r in seen)
        assert not seen[0].flags.writeable
        np.testing.assert_array_equal(seen[0], np.full(1000, 6.0))

    async def test_large_arrays_split_over_worker_threads(self) -> None:
        """Arrays over the inline threshold reduce in the device threads, same result."""
        strategy = MirroredStrategy(host_devices(3))
        data = [np.arange(INLINE_BYTES // 8, dtype=np.float64) * (i + 1) for i in range(3)]

        async def step(x: np.ndarray[Any, Any]) -> Any:
            return await replica_context().all_reduce(ReduceOp.SUM, x)

        result = await strategy.run(step, args=(PerReplica(data),))
        np.testing.assert_array_equal(result, np.arange(INLINE_BYTES // 8, dtype=np.float64) * 6)

    async def test_nested_structure_and_scalars(self) -> None:
        """Nested structures reduce leaf by leaf; scalars become 0-d arrays."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            value = {"w": np.ones(3) * replica_id(), "stats": (replica_id(), 2.5)}
            return await replica_context().all_reduce("sum", value)

        result = await strategy.run(step)
        np.testing.assert_array_equal(result["w"], [1.0, 1.0, 1.0])
        assert result["stats"][0] == 1
        assert result["stats"][1] == 5.0
        assert np.ndim(result["stats"][1]) == 0

    async def test_same_object_on_every_replica(self) -> None:
        """A value every replica passes as the same object counts once per replica."""
        strategy = MirroredStrategy(host_devices(3))
        shared = np.arange(4.0)

        async def step() -> Any:
            return await replica_context().all_reduce("sum", shared)

        np.testing.assert_array_equal(await strategy.run(step), shared * 3)

    async def test_small_leaves_are_packed(self) -> None:
        """Small leaves of one dtype are reduced in one pack: their results share a buffer."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            grads = [np.full(10, float(i + replica_id())) for i in range(20)]
            return await replica_context().all_reduce("sum", grads)

        result = await strategy.run(step)
        for i, got in enumerate(result):
            np.testing.assert_array_equal(got, np.full(10, 2.0 * i + 1))
        assert result[0].base is not None
        assert result[0].base is result[19].base  # views of one reduced pack

    async def test_bytes_per_pack_bounds_packs(self) -> None:
        """With a small bytes_per_pack, leaves go in several packs no bigger than it."""
        options = CommunicationOptions(bytes_per_pack=160)
        strategy = MirroredStrategy(host_devices(2), communication_options=options)

        async def step() -> Any:
            return await replica_context().all_reduce("sum", [np.ones(10) for _ in range(4)])

        result = await strategy.run(step)
        assert result[0].base is result[1].base  # 80 + 80 bytes: one pack
        assert result[1].base is not result[2].base  # the third starts a new one
        np.testing.assert_array_equal(result[3], np.full(10, 2.0))

    async def test_shape_mismatch_names_replicas_and_path(self) -> None:
        """Different shapes are a ValueError naming both replicas, the key path and shapes."""
        strategy = MirroredStrategy(host_devices(3))

        async def step() -> Any:
            size = 4 if replica_id() == 2 else 3
            return await replica_context().all_reduce("sum", {"w": np.zeros(size)})

        with pytest.raises(
            ValueError,
            match=(
                r"all_reduce: replica 2's value at \['w'\] has shape \(4,\) and dtype float64, "
                r"replica 0's has shape \(3,\) and dtype float64"
            ),
        ):
            await strategy.run(step)

    async def test_dtype_mismatch(self) -> None:
        """Different dtypes are a ValueError naming both."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            dtype = np.float32 if replica_id() else np.float64
            return await replica_context().all_reduce("sum", np.zeros(2, dtype=dtype))

        with pytest.raises(ValueError, match=r"dtype float32, replica 0's has shape .* float64"):
            await strategy.run(step)

    @pytest.mark.parametrize(
        "collective", ["all_reduce", "all_gather", "broadcast", "reduce_scatter"]
    )
    async def test_structure_mismatch(self, collective: str) -> None:
        """Different structures are a ValueError naming the collective, the replicas and the
        place in the value passed to it (from its root, not among the collective's own
        arguments)."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            value = {"x": [np.zeros(2)] * (replica_id() + 1)}
            ctx = replica_context()
            if collective == "all_reduce":
                return await ctx.all_reduce("sum", value)
            if collective == "reduce_scatter":
                return await ctx.reduce_scatter("sum", value)
            return await getattr(ctx, collective)(value)

        with pytest.raises(
            ValueError,
            match=rf"^{collective}: replica 1's value differs from replica 0's at \['x'\]: "
            r"replica 0 has a list of 1 item, replica 1 a list of 2 items; every replica must "
            r"pass the same structure\n",
        ):
            await strategy.run(step)

    @pytest.mark.parametrize(
        ("op", "dtype", "message"),
        [
            ("mean", np.int32, "cannot MEAN values of dtype int32 .*cast to a floating dtype"),
            ("max", np.complex128, "cannot MAX values of dtype complex128 .*no order"),
            ("sum", np.bool_, "cannot SUM values of dtype bool .*MAX \\(any\\)"),
        ],
    )
    async def test_op_the_dtype_cannot_do(self, op: str, dtype: Any, message: str) -> None:
        """An op the dtype cannot do is a TypeError with advice, before any work."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            return await replica_context().all_reduce(op, np.zeros(3, dtype=dtype))

        with pytest.raises(TypeError, match=message):
            await strategy.run(step)

    async def test_foreign_arrays_rejected(self) -> None:
        """Arrays of another backend (a CuPy array on host devices) are a TypeError."""

        class FakeCupyArray:
            shape = (2,)

        FakeCupyArray.__module__ = "cupy._core.core"
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            value = FakeCupyArray() if replica_id() else np.zeros(2)
            return await replica_context().all_reduce("sum", value)

        with pytest.raises(
            TypeError,
            match=r"mixes array types .*replica 1 passes cupy\._core\.core\.FakeCupy",
        ):
            await strategy.run(step)

    @pytest.mark.parametrize("per_replica", [True, False], ids=["per replica", "one value"])
    async def test_foreign_arrays_on_every_replica_are_no_mix(self, per_replica: bool) -> None:
        """Every replica passing an array of another backend mixes nothing: the message says
        the value is not an array of the strategy's backend, naming the type once."""

        class FakeCupyArray:
            shape = (2,)

        FakeCupyArray.__module__ = "cupy._core.core"
        strategy = MirroredStrategy(host_devices(2))
        shared = FakeCupyArray()

        async def step() -> Any:
            return await replica_context().all_reduce(
                "sum", FakeCupyArray() if per_replica else shared
            )

        passed = "every replica passes" if per_replica else "it is"
        with pytest.raises(TypeError) as caught:
            await strategy.run(step)
        assert str(caught.value).startswith(
            f"all_reduce: the value is not a numpy array ({passed} a "
            "cupy._core.core.FakeCupyArray), but this strategy's devices hold numpy arrays; "
            "put each value on its replica's device with ctx.device.asarray(value)"
        ), str(caught.value)

    async def test_an_int_too_large_for_numpy_is_named_on_its_replica(self) -> None:
        """A Python int beyond 64 bits from one replica is a ValueError (TF's out-of-range
        integer) naming that replica and saying why, not a shape or dtype mismatch blamed on
        the others."""
        strategy = MirroredStrategy(host_devices(3))

        async def step() -> Any:
            value = 2**70 if replica_id() == 1 else 1
            return await replica_context().all_reduce("sum", {"n": value})

        with pytest.raises(
            ValueError,
            match=r"^all_reduce: replica 1's value at \['n'\] is the int 1180591620717411303424, "
            r"which does not fit int64 \(-9223372036854775808 to 9223372036854775807\)",
        ):
            await strategy.run(step)

    async def test_timeout_names_late_replicas(self) -> None:
        """timeout_seconds fails the run with ReplicaSyncError naming who was late."""
        strategy = MirroredStrategy(host_devices(3))
        never = anyio.Event()

        async def step() -> Any:
            if replica_id() == 1:
                await never.wait()
            options = CommunicationOptions(timeout_seconds=0.05)
            return await replica_context().all_reduce("sum", np.zeros(1), options=options)

        with pytest.raises(ReplicaSyncError) as info:
            await strategy.run(step)
        assert (info.value.replicas, info.value.waiting) == ((1,), (0, 2))
        assert "waited 0.05 s" in str(info.value)

    @pytest.mark.parametrize("write", ["assign", "update", "apply_gradients"])
    async def test_the_strategys_timeout_bounds_writes_and_steps(self, write: str) -> None:
        """A variable write, update() and an optimizer step in a replica are collectives:
        the strategy's timeout_seconds bounds their wait for a replica that never comes,
        naming it, and nothing changes."""
        options = CommunicationOptions(timeout_seconds=0.1)
        strategy = MirroredStrategy(host_devices(3), communication_options=options)
        with strategy.scope():
            v = aioreplica.Variable(np.zeros(2), name="v")
        optimizer = aioreplica.optimizers.SGD(0.1)
        never = anyio.Event()

        async def step() -> None:
            if replica_id() == 2:
                await never.wait()
            if write == "assign":
                await v.assign(np.ones(2))
            elif write == "update":
                await strategy.extended.update(v, lambda copy: copy + 1)
            else:
                await optimizer.apply_gradients([(np.ones(2), v)])

        with anyio.fail_after(10), pytest.raises(ReplicaSyncError) as info:
            await strategy.run(step)
        assert (info.value.replicas, info.value.waiting) == ((2,), (0, 1))
        assert "waited 0.1 s" in str(info.value)
        assert optimizer.iterations == 0
        for copy in v.values:
            np.testing.assert_array_equal(copy, np.zeros(2), strict=True)

    async def test_a_timeout_of_zero_turns_the_strategys_off(self) -> None:
        """A collective's timeout_seconds=0 waits however late a replica is, even where the
        strategy's options set a timeout (TF's "zero disables timeout"); without it the
        strategy's timeout applies."""
        options = CommunicationOptions(timeout_seconds=0.05)
        strategy = MirroredStrategy(host_devices(2), communication_options=options)

        async def step(per_call: CommunicationOptions | None) -> Any:
            if replica_id() == 1:
                await anyio.sleep(0.3)  # late, past the strategy's 0.05 s
            return await replica_context().all_reduce("sum", np.ones(1), options=per_call)

        off = CommunicationOptions(timeout_seconds=0)
        result = await strategy.run(step, args=(off,))
        assert [r.tolist() for r in strategy.experimental_local_results(result)] == [[2.0]] * 2
        with pytest.raises(ReplicaSyncError) as info:
            await strategy.run(step, args=(None,))
        assert (info.value.replicas, info.value.waiting) == ((1,), (0,))

    @pytest.mark.parametrize("collective", ["all_reduce", "barrier"])
    async def test_a_timeout_of_zero_turns_sync_timeout_off(self, collective: str) -> None:
        """A collective's timeout_seconds=0 waits however late a replica is past the
        strategy's sync_timeout too, as a positive one replaces it; without options the
        sync_timeout applies."""
        strategy = MirroredStrategy(host_devices(2), sync_timeout=0.05)

        async def step(per_call: CommunicationOptions | None) -> Any:
            if replica_id() == 1:
                await anyio.sleep(0.3)  # late, past the strategy's 0.05 s
            if collective == "barrier":
                await replica_context().barrier(options=per_call)
                return np.full(1, 2.0)
            return await replica_context().all_reduce("sum", np.ones(1), options=per_call)

        outcomes: list[tuple[Any, ...]] = []
        for per_call in (CommunicationOptions(timeout_seconds=0), None):
            try:
                result = await strategy.run(step, args=(per_call,))
            except ReplicaSyncError as exc:
                outcomes.append(("late", exc.replicas, exc.waiting))
            else:
                outcomes.append(("ran", [r.tolist() for r in local(strategy, result)]))
        assert outcomes == [("ran", [[2.0], [2.0]]), ("late", (1,), (0,))]

    async def test_a_timeout_of_zero_in_the_strategys_options_turns_sync_timeout_off(
        self,
    ) -> None:
        """timeout_seconds=0 in the strategy's options waits past its sync_timeout in the
        collectives, as a positive one there bounds them in its place."""
        strategy = MirroredStrategy(
            host_devices(2),
            sync_timeout=0.05,
            communication_options=CommunicationOptions(timeout_seconds=0),
        )

        async def step() -> Any:
            if replica_id() == 1:
                await anyio.sleep(0.3)  # late, past the strategy's 0.05 s
            return await replica_context().all_reduce("sum", np.ones(1))

        result = await strategy.run(step)
        assert [r.tolist() for r in local(strategy, result)] == [[2.0]] * 2


class TestSettingsMustAgree:
    """A collective's settings (op, axis, source, options) must be equal on every replica."""

    async def test_all_reduce_ops_that_differ(self) -> None:
        """Replica 0 summing while the others take the max is refused, not silently summed."""
        strategy = MirroredStrategy(host_devices(3))
        reduced: list[Any] = []

        async def step() -> None:
            op = "sum" if replica_id() == 0 else "max"
            reduced.append(await replica_context().all_reduce(op, np.full(2, float(replica_id()))))

        with pytest.raises(ReplicaSyncError, match="disagree on the reduce op") as info:
            await strategy.run(step)
        assert (info.value.merge_number, info.value.replicas) == (1, (0,))
        assert "replica 0 passed <ReduceOp.SUM: 'sum'>" in str(info.value)
        assert reduced == []

    async def test_equal_settings_made_per_replica_agree(self) -> None:
        """Equal ops and options built separately in every replica are one setting."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            options = CommunicationOptions(bytes_per_pack=64)
            return await replica_context().all_reduce(ReduceOp.parse("SUM"), np.ones(2), options)

        np.testing.assert_array_equal(await strategy.run(step), [2.0, 2.0])

    async def test_gather_axes_that_differ(self) -> None:
        """all_gather along different axes per replica is a ReplicaSyncError."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            return await replica_context().all_gather(np.ones((2, 2)), axis=replica_id())

        with pytest.raises(ReplicaSyncError, match="disagree on the axis of all_gather"):
            await strategy.run(step)

    async def test_broadcast_sources_that_differ(self) -> None:
        """Each replica naming itself as the source is a ReplicaSyncError."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            return await replica_context().broadcast(np.ones(2), source_replica=replica_id())

        with pytest.raises(ReplicaSyncError, match="disagree on the source_replica"):
            await strategy.run(step)


class TestOtherReplicaCollectives:
    async def test_all_gather_uneven(self) -> None:
        """all_gather concatenates uneven batches in replica order, for every replica."""
        strategy = MirroredStrategy(host_devices(3))

        async def step() -> Any:
            return await replica_context().all_gather(np.full((replica_id() + 1, 2), replica_id()))

        result = await strategy.run(step)
        np.testing.assert_array_equal(
            result, np.array([[0, 0], [1, 1], [1, 1], [2, 2], [2, 2], [2, 2]])
        )

    async def test_all_gather_on_another_axis(self) -> None:
        """all_gather along axis 1 keeps the leading dimension."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            return await replica_context().all_gather(np.full((2, 1), replica_id()), axis=1)

        np.testing.assert_array_equal(await strategy.run(step), [[0, 1], [0, 1]])

    async def test_all_gather_shapes_off_axis_must_match(self) -> None:
        """Shapes may differ only along the gather axis."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            return await replica_context().all_gather(np.zeros((2, replica_id() + 1)))

        with pytest.raises(ValueError, match="they may differ only along axis 0"):
            await strategy.run(step)

    async def test_axis_out_of_range(self) -> None:
        """An axis the value does not have is a ValueError naming it."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            return await replica_context().all_gather(np.zeros(3), axis=2)

        with pytest.raises(ValueError, match=r"axis 2 is out of range .* 1 dimension"):
            await strategy.run(step)

    @pytest.mark.parametrize("axis", [True, "0", 0.0, None])
    async def test_axis_must_be_an_integer(self, axis: Any) -> None:
        """As for NumPy, an axis that is not an integer (a bool included) is a TypeError, in
        every collective that takes one."""
        strategy = MirroredStrategy(host_devices(2))
        value = PerReplica([np.zeros((2, 2)), np.ones((2, 2))])
        shown = f"got {type(axis).__name__} {axis!r}"

        async def all_gather() -> Any:
            return await replica_context().all_gather(np.zeros((2, 2)), axis=axis)

        async def reduce_scatter() -> Any:
            return await replica_context().reduce_scatter("sum", np.zeros((2, 2)), axis=axis)

        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "all_gather": lambda: strategy.run(all_gather),
            "reduce_scatter": lambda: strategy.run(reduce_scatter),
            "gather": lambda: strategy.gather(value, axis),
        }
        if axis is not None:  # (reduce's default: no axis)
            calls["reduce"] = lambda: strategy.reduce("sum", value, axis)
        for what, call in calls.items():
            also = " or a tuple of integers" if what == "reduce" else ""
            with pytest.raises(TypeError, match=f"{what}: axis must be an integer{also}, {shown}"):
                await call()

    async def test_numpy_integer_axes(self) -> None:
        """An axis computed with NumPy (``np.int64``) is an axis like any int."""
        strategy = MirroredStrategy(host_devices(2))
        value = PerReplica([np.zeros((2, 1)), np.ones((2, 1))])
        one = np.int64(1)

        async def step() -> Any:
            mine = np.full((2, 1), float(replica_id()))
            gathered = await replica_context().all_gather(mine, axis=one)
            scattered = await replica_context().reduce_scatter("sum", np.ones((1, 2)), axis=one)
            return gathered, scattered

        gathered, scattered = await strategy.run(step)
        np.testing.assert_array_equal(gathered, [[0.0, 1.0], [0.0, 1.0]])
        assert [s.tolist() for s in scattered.values] == [[[2.0]], [[2.0]]]
        np.testing.assert_array_equal(await strategy.gather(value, one), [[0.0, 1.0], [0.0, 1.0]])
        np.testing.assert_array_equal(await strategy.reduce("sum", value, np.int64(0)), [2.0])

    async def test_broadcast(self) -> None:
        """Every replica gets the source replica's value; the others' are ignored."""
        strategy = MirroredStrategy(host_devices(3))

        async def step() -> Any:
            return await replica_context().broadcast(
                {"w": np.full(2, float(replica_id()))}, source_replica=1
            )

        result = await strategy.run(step)
        np.testing.assert_array_equal(result["w"], [1.0, 1.0])
        assert not result["w"].flags.writeable

    async def test_broadcast_from_a_numpy_integer(self) -> None:
        """A source replica chosen with NumPy (``np.argmax``) is a replica id."""
        strategy = MirroredStrategy(host_devices(3))

        async def step() -> Any:
            losses = np.array([3.0, 1.0, 2.0])
            mine = np.full(2, float(replica_id()))
            return await replica_context().broadcast(mine, source_replica=np.argmin(losses))

        np.testing.assert_array_equal(await strategy.run(step), [1.0, 1.0])

    def test_timeout_from_numpy(self) -> None:
        seconds: Any = np.float32(0.5)  # the field is typed float; NumPy's are taken too
        options = CommunicationOptions(timeout_seconds=seconds)
        assert options.timeout_seconds == 0.5
        assert type(options.timeout_seconds) is float

    def test_pack_size_from_numpy(self) -> None:
        # The field is typed int, what it holds; NumPy's integers are taken at run time.
        options = CommunicationOptions(bytes_per_pack=np.int64(1024))  # type: ignore[arg-type]
        assert options.bytes_per_pack == 1024
        assert type(options.bytes_per_pack) is int

    async def test_broadcast_source_out_of_range(self) -> None:
        """A source replica that does not exist is a ValueError."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            return await replica_context().broadcast(np.zeros(1), source_replica=2)

        with pytest.raises(ValueError, match="source_replica must be a replica id from 0 to 1"):
            await strategy.run(step)

    @pytest.mark.parametrize("source", [None, "0", True, 1.5])
    async def test_broadcast_source_of_another_type(self, source: Any) -> None:
        """A source replica that is no int (a bool is not one) is a TypeError, in the replica
        that passed it; the strategy goes on."""
        strategy = MirroredStrategy(host_devices(2))

        async def step(source: Any) -> Any:
            return await replica_context().broadcast(np.zeros(1), source_replica=source)

        message = (
            "source_replica must be a replica id from 0 to 1, got "
            f"{type(source).__name__} {source!r}"
        )
        with pytest.raises(TypeError, match=f"^{re.escape(message)}") as info:
            await strategy.run(step, args=(source,))
        assert str(info.value) == message
        result = await strategy.run(step, args=(np.int64(1),))
        np.testing.assert_array_equal(result, [0.0])

    async def test_reduce_scatter(self) -> None:
        """Replica i gets the i-th array_split chunk of the reduced value."""
        strategy = MirroredStrategy(host_devices(3))

        async def step() -> Any:
            return await replica_context().reduce_scatter(
                "sum", np.arange(8.0) * (replica_id() + 1)
            )

        result = await strategy.run(step)
        total = np.arange(8.0) * 6
        for got, want in zip(local(strategy, result), np.array_split(total, 3), strict=True):
            np.testing.assert_array_equal(got, want)

    async def test_barrier(self) -> None:
        """No replica passes the barrier before every replica has reached it."""
        strategy = MirroredStrategy(host_devices(3))
        events: list[str] = []

        async def step() -> None:
            for _ in range(replica_id() * 2):
                await anyio.lowlevel.checkpoint()
            events.append("before")
            await replica_context().barrier()
            events.append("after")

        await strategy.run(step)
        assert events == ["before"] * 3 + ["after"] * 3


async def destination_refusals(calls: list[Callable[[], Awaitable[Any]]]) -> list[str]:
    """The message of the ValueError about a destination that each of ``calls`` raises."""
    refused = []
    for call in calls:
        with pytest.raises(ValueError, match=r"^destination ") as info:
            await call()
        refused.append(str(info.value))
    return refused


class TestCrossReplica:
    async def test_reduce(self) -> None:
        """strategy.reduce combines a PerReplica across replicas."""
        strategy = MirroredStrategy(host_devices(2))
        value = PerReplica([np.array([1.0, 2.0]), np.array([3.0, 4.0])])
        np.testing.assert_array_equal(await strategy.reduce("sum", value), [4.0, 6.0])
        np.testing.assert_array_equal(await strategy.reduce(ReduceOp.MEAN, value), [2.0, 3.0])

    async def test_reduce_mean_along_axis_weights_by_rows(self) -> None:
        """MEAN with axis=0 divides by the real number of rows, empty batches included."""
        strategy = MirroredStrategy(host_devices(3))
        value = PerReplica([np.array([1.0, 2.0, 3.0]), np.array([]), np.array([6.0])])
        assert await strategy.reduce("mean", value, axis=0) == 3.0
        assert await strategy.reduce("sum", value, axis=0) == 12.0
        assert await strategy.reduce("max", value, axis=0) == 6.0

    @pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
    @pytest.mark.parametrize("axis", [(0, 1), [1, 0], (-3, 1), (0, 2)])
    async def test_reduce_along_several_axes(self, op: str, axis: Any) -> None:
        """A tuple or list of axes reduces each replica's component along all of them, then
        across replicas, as NumPy reduces the replicas' batches joined along axis 0; MEAN
        divides by the elements along those axes over all replicas (an empty batch counts for
        nothing)."""
        strategy = MirroredStrategy(host_devices(3))
        rng = np.random.default_rng(5)
        batches = [rng.normal(size=(rows, 3, 2)) + 2 for rows in (2, 0, 3)]
        if 0 not in [a % 3 for a in axis]:  # replicas may differ only along reduced axes
            batches = [rng.normal(size=(2, 3, 2)) + 2 for _ in range(3)]
        value = PerReplica(batches)
        joined = np.concatenate(batches)
        want = getattr(np, op)(joined, axis=tuple(axis))
        if 0 not in [a % 3 for a in axis]:  # the replicas themselves combine elementwise
            stacked = np.stack([getattr(np, op)(b, axis=tuple(axis)) for b in batches])
            want = NUMPY_REDUCE[op](stacked)
            if op == "mean":
                want = np.mean(np.stack(batches), axis=(0, *(a + 1 for a in axis)))
        np.testing.assert_allclose(await strategy.reduce(op, value, axis=axis), want, rtol=1e-12)

    async def test_reduce_along_several_axes_takes_tfs_default_strategy_case(self) -> None:
        """TF's own case, on the default strategy: MEAN of one 2x2 value over no axis, axis 0
        and both axes."""
        strategy = aioreplica.get_strategy()
        x = np.array([[1.0, 2.0], [3.0, 4.0]])
        np.testing.assert_array_equal(await strategy.reduce("mean", x, axis=None), x)
        np.testing.assert_array_equal(await strategy.reduce("mean", x, axis=0), [2.0, 3.0])
        assert await strategy.reduce("mean", x, axis=(0, 1)) == 2.5

    @pytest.mark.parametrize(
        ("axis", "error", "message"),
        [
            ((0, 0), ValueError, r"axis \(0, 0\) names an axis twice"),
            ([1, -1], ValueError, r"axis \(1, -1\) names an axis twice"),
            ((0, 2), ValueError, "axis 2 is out of range"),
            ((0, 0.5), TypeError, r"axis must be an integer or a tuple of integers, got tuple"),
            ((True,), TypeError, "axis must be an integer or a tuple of integers"),
        ],
    )
    async def test_reduce_refuses_bad_axes(self, axis: Any, error: type, message: str) -> None:
        strategy = MirroredStrategy(host_devices(2))
        value = PerReplica([np.ones((2, 2)), np.ones((1, 2))])
        with pytest.raises(error, match=f"reduce: {message}"):
            await strategy.reduce("sum", value, axis=axis)

    async def test_reduce_along_axes_that_leave_a_differing_axis(self) -> None:
        """Components may differ only along the reduced axes, as with one axis."""
        strategy = MirroredStrategy(host_devices(2))
        value = PerReplica([np.ones((2, 3, 2)), np.ones((1, 3, 2))])
        with pytest.raises(ValueError, match=r"they may differ only along axes \(1, 2\)"):
            await strategy.reduce("sum", value, axis=(1, 2))

    @pytest.mark.parametrize("replicas", [2, 3])
    async def test_mean_of_integers_is_a_float_mean(self, replicas: int) -> None:
        """TF's testReduceAxisToCpu with int32: strategy.reduce's MEAN of integers divides
        truly (float64, as np.mean), with or without axis; SUM keeps the dtype."""
        strategy = MirroredStrategy(host_devices(replicas))
        rows = PerReplica([np.array([i] * (i + 1), np.int32) for i in range(replicas)])
        total = sum(i * (i + 1) for i in range(replicas))
        summed = await strategy.reduce("sum", rows, axis=0)
        assert (summed, summed.dtype) == (total, np.dtype(np.int32))
        mean = await strategy.reduce("mean", rows, axis=0)
        assert mean.dtype == np.dtype(np.float64)
        assert mean == pytest.approx(total / sum(i + 1 for i in range(replicas)))
        pairs = PerReplica([np.array([i, 2 * i], np.int64) for i in range(replicas)])
        np.testing.assert_array_equal(
            await strategy.reduce("mean", pairs),
            np.mean([[i, 2 * i] for i in range(replicas)], axis=0),
            strict=True,
        )

    async def test_reduce_mean_along_axis_gives_an_array_as_the_other_ops(self) -> None:
        """Every op with axis, MEAN included, gives a 0-d ndarray where the result has no
        dimension left, as MEAN without axis does (not a NumPy scalar)."""
        strategy = MirroredStrategy(host_devices(2))
        value = PerReplica([np.array([1.0, 2.0], np.float32), np.array([3.0], np.float32)])
        got = {op: await strategy.reduce(op, value, axis=0) for op in ("sum", "mean", "max")}
        got["mean of nothing"] = await strategy.reduce(
            "mean", PerReplica([np.array([]), np.array([])]), axis=0
        )
        got["mean without axis"] = await strategy.reduce("mean", PerReplica([1.0, 2.0]))
        shown = {op: (type(r), r.shape) for op, r in got.items()}
        assert shown == dict.fromkeys(got, (np.ndarray, ()))
        assert got["mean"] == 2.0
        assert got["mean"].dtype == np.float32
        assert np.isnan(got["mean of nothing"])

    @pytest.mark.parametrize("replicas", [1, 2, 3])
    async def test_reduce_to_takes_a_mean_of_integers_as_reduce_does(self, replicas: int) -> None:
        """reduce_to and batch_reduce_to take MEAN of integers as strategy.reduce does: a
        float64 mean, on every destination."""
        strategy = MirroredStrategy(host_devices(replicas))
        value = PerReplica([np.array([i, 2 * i + 1], np.int32) for i in range(replicas)])
        want = await strategy.reduce("mean", value)
        assert want.dtype == np.float64
        one = await strategy.extended.reduce_to("mean", value, "cpu:0")
        (batched,) = await strategy.extended.batch_reduce_to("mean", [(value, value)])
        every = strategy.experimental_local_results(batched)
        for got in (one, *every):
            np.testing.assert_array_equal(got, want, strict=True)

    async def test_mean_of_integers_and_floats_is_refused(self) -> None:
        """A MEAN of one replica's integers with another's floats is refused as for any other
        op (the integers are not made floats first), naming both dtypes."""
        strategy = MirroredStrategy(host_devices(2))
        value = PerReplica([np.array([1], np.int32), np.array([2.0], np.float32)])
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: strategy.reduce("mean", value),
            lambda: strategy.reduce("mean", value, axis=0),
            lambda: strategy.extended.reduce_to("mean", value, "cpu:0"),
        ]
        messages = []
        for call in calls:
            with pytest.raises(ValueError, match=r"^reduce") as info:
                await call()
            messages.append(str(info.value))
        differ = (
            "replica 1's value at <root> has shape (1,) and dtype float32, replica 0's has "
            "shape (1,) and dtype int32; "
        )
        assert messages == [
            f"reduce: {differ}every replica must pass the same shape and dtype",
            f"reduce: {differ}they may differ only along axis 0",
            f"reduce_to: {differ}every replica must pass the same shape and dtype",
        ]

    async def test_a_variable_of_another_strategy_is_refused(self) -> None:
        """reduce, reduce_to and batch_reduce_to refuse another strategy's variable, whatever
        its number of copies, naming both strategies; its own strategy reduces it."""
        strategy = MirroredStrategy(host_devices(2))
        other = MirroredStrategy(host_devices(2))
        with other.scope():
            theirs = aioreplica.Variable(1.0, synchronization="on_read", aggregation="sum")
        message = rf"^variable 'Variable' belongs to {re.escape(repr(other))}, not "
        with pytest.raises(ValueError, match=message):
            await strategy.reduce("sum", theirs)
        with pytest.raises(ValueError, match=message):
            await strategy.extended.reduce_to("sum", {"v": theirs}, "cpu:0")
        assert await other.reduce("sum", theirs) == 2.0

    async def test_reduce_along_axis_of_nothing(self) -> None:
        """MAX over batches that are all empty has nothing to reduce."""
        strategy = MirroredStrategy(host_devices(2))
        value = PerReplica([np.array([]), np.array([])])
        with pytest.raises(ValueError, match="every replica's value at <root> is empty"):
            await strategy.reduce("max", value, axis=0)

    async def test_reduce_inside_a_replica(self) -> None:
        """strategy.reduce inside a replica is a RuntimeError pointing to ctx.all_reduce."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            return await strategy.reduce("sum", np.zeros(1))

        with pytest.raises(RuntimeError, match=r"strategy.reduce\(\) was called inside replica"):
            await strategy.run(step)

    async def test_extended_calls_inside_a_replica_name_themselves(self) -> None:
        """reduce_to, batch_reduce_to and broadcast_to inside a replica each raise a
        RuntimeError naming that call by its path, strategy.extended (one replica: which
        replica raises first is the loop's choice)."""
        strategy = MirroredStrategy(host_devices(1))
        extended = strategy.extended
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "reduce_to": lambda: extended.reduce_to("sum", 1.0, "cpu:0"),
            "batch_reduce_to": lambda: extended.batch_reduce_to("sum", [(1.0, "cpu:0")]),
            "broadcast_to": lambda: extended.broadcast_to(1.0, "cpu:0"),
        }
        messages = []
        for call in calls.values():

            async def step(call: Callable[[], Awaitable[Any]] = call) -> None:
                await call()

            with pytest.raises(RuntimeError) as info:
                await strategy.run(step)
            messages.append(str(info.value).partition(";")[0])
        assert messages == [
            f"strategy.extended.{name}() was called inside replica 0" for name in calls
        ]

    async def test_reduce_to_describes_its_value_as_reduce_does(self) -> None:
        """reduce_to's errors describe the value passed as reduce's do: the value itself is
        the root, not an item of a list; batch_reduce_to's name the item of its list."""
        strategy = MirroredStrategy(host_devices(2))
        extended = strategy.extended
        three = PerReplica([1.0, 2.0, 3.0])
        flags = PerReplica([np.True_, np.False_])
        calls: list[tuple[type[Exception], Callable[[], Awaitable[Any]]]] = [
            (ValueError, lambda: strategy.reduce("sum", three)),
            (ValueError, lambda: extended.reduce_to("sum", three, "cpu:0")),
            (
                ValueError,
                lambda: extended.batch_reduce_to("sum", [(1.0, "cpu:0"), (three, "cpu:0")]),
            ),
            (TypeError, lambda: strategy.reduce("mean", flags)),
            (TypeError, lambda: extended.reduce_to("mean", flags, "cpu:0")),
            (TypeError, lambda: extended.reduce_to("mean", {"ok": flags}, "cpu:0")),
        ]
        messages = []
        for error, call in calls:
            with pytest.raises(error) as info:
                await call()
            messages.append(str(info.value).partition(";")[0])
        length = "the value at {} is a PerReplica of 3 values, but the strategy has 2 replicas"
        bools = "cannot MEAN values of dtype bool (at {}): bool values reduce with MAX (any) or MIN"
        assert messages == [
            "reduce: " + length.format("<root>"),
            "reduce_to: " + length.format("<root>"),
            "batch_reduce_to: " + length.format("[1]"),
            bools.format("<root>") + " (all)",
            bools.format("<root>") + " (all)",
            bools.format("['ok']") + " (all)",
        ]

    async def test_gather(self) -> None:
        """strategy.gather concatenates the components along the axis."""
        strategy = MirroredStrategy(host_devices(2))
        value = PerReplica([np.array([1, 2]), np.array([3])])
        np.testing.assert_array_equal(await strategy.gather(value), [1, 2, 3])

    async def test_reduce_to_and_batch(self) -> None:
        """reduce_to places on one or several destinations; batch_reduce_to does several."""
        strategy = MirroredStrategy(host_devices(2))
        value = PerReplica([np.array([1.0]), np.array([2.0])])
        one = await strategy.extended.reduce_to("sum", value, "/device:CPU:1")
        np.testing.assert_array_equal(one, [3.0])
        both = await strategy.extended.reduce_to("sum", value, value)
        assert isinstance(both, np.ndarray | Mirrored)
        many = await strategy.extended.batch_reduce_to("mean", [(value, "cpu:0")] * 3)
        assert [float(m[0]) for m in many] == [1.5, 1.5, 1.5]
        with pytest.raises(ValueError, match="destination 'cpu:7' is not one of"):
            await strategy.extended.reduce_to("sum", value, "cpu:7")

    @pytest.mark.parametrize("destination", [np.zeros(1), np.float32(0.0), np.array(0)])
    async def test_reduce_to_a_host_array_means_the_first_host_device(
        self, destination: Any
    ) -> None:
        """TF's ``reduce_to(op, value, destinations=tensor)`` reduces to the tensor's device: a
        host array or NumPy scalar means the host, the strategy's first device, so one value
        comes back (as for ``"cpu:1"`` here), not a Mirrored."""
        strategy = MirroredStrategy(["cpu:1", "cpu:2"])
        value = PerReplica([np.array([1.0]), np.array([2.0])])
        one = await strategy.extended.reduce_to("sum", value, destination)
        assert type(one) is np.ndarray
        np.testing.assert_array_equal(one, [3.0])
        pairs = [(value, destination), (value, [destination, "cpu:2"])]
        single, both = await strategy.extended.batch_reduce_to("max", pairs)
        np.testing.assert_array_equal(single, [2.0])
        assert isinstance(both, Mirrored)
        assert len(both.values) == 2

    @pytest.mark.parametrize("destination", [5, 0.0, True, [0.0, "cpu:2"]])
    async def test_a_python_number_is_no_destination(self, destination: Any) -> None:
        """A Python number is on no device: reduce_to, batch_reduce_to and broadcast_to refuse
        it with a ValueError, as TF's validate_destinations does, and place nothing."""
        strategy = MirroredStrategy(["cpu:1", "cpu:2"])
        value = PerReplica([np.array([1.0]), np.array([2.0])])
        number = destination[0] if isinstance(destination, list) else destination
        message = (
            f"destination {number!r} is a Python {type(number).__name__}, which is on no "
            "device; destinations are a device name (such as 'cpu:0'), a list of names, a "
            "distributed value, a variable, or an array (its device)"
        )
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: strategy.extended.reduce_to("sum", value, destination),
            lambda: strategy.extended.batch_reduce_to(
                "sum", [(value, "cpu:1"), (value, destination)]
            ),
            lambda: strategy.extended.broadcast_to(np.ones(1), destination),
        ]
        assert await destination_refusals(calls) == [message] * 3
        summed = await strategy.extended.reduce_to("sum", value, "cpu:1")
        np.testing.assert_array_equal(summed, [3.0])

    async def test_a_variable_of_another_strategy_is_no_destination(self) -> None:
        """A variable of another strategy as destinations: reduce_to, batch_reduce_to and
        broadcast_to refuse it with a ValueError naming it and both strategies' devices, and
        place nothing; an ordinary variable means its device, as a name would."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        other = MirroredStrategy(["cpu:2", "cpu:3"])
        with other.scope():
            foreign = aioreplica.Variable(np.ones(1), name="foreign")
        ordinary = aioreplica.Variable(np.ones(1), name="ordinary")
        value = PerReplica([np.array([1.0]), np.array([2.0])])
        message = (
            f"destination variable 'foreign' belongs to {other!r}, not to this strategy, "
            "whose devices are ['cpu:0', 'cpu:1']; pass a variable of this strategy, or the "
            "names of its devices"
        )
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: strategy.extended.reduce_to("sum", value, foreign),
            lambda: strategy.extended.batch_reduce_to("sum", [(value, "cpu:1"), (value, foreign)]),
            lambda: strategy.extended.broadcast_to(np.ones(1), foreign),
        ]
        assert await destination_refusals(calls) == [message] * 3
        placed = [
            await strategy.extended.reduce_to("sum", value, ordinary),
            await strategy.extended.broadcast_to(np.full(1, 5.0), ordinary),
        ]
        assert [(a.tolist(), a.flags.writeable) for a in placed] == [([3.0], False), ([5.0], False)]
        other.close()

    async def test_bad_pairs_and_destinations_are_refused(self) -> None:
        """batch_reduce_to's pairs must be (value, destinations) pairs, and destinations name
        each device once: TypeError / ValueError saying which, nothing reduced."""
        strategy = MirroredStrategy(host_devices(2))
        value = PerReplica([np.array([1.0]), np.array([2.0])])
        batch = strategy.extended.batch_reduce_to
        with pytest.raises(TypeError, match=r"^batch_reduce_to\(\): item 1 must be a \(value, "):
            await batch("sum", [(value, "cpu:0"), (value,)])  # type: ignore[list-item]
        with pytest.raises(TypeError, match=r"^batch_reduce_to\(\): item 0 must be a \(value, "):
            await batch("sum", [5])  # type: ignore[list-item]
        with pytest.raises(TypeError, match=r"^batch_reduce_to\(\) takes a list of \(value, "):
            await batch("sum", 5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^destination 'cpu:1' is listed twice in"):
            await strategy.extended.reduce_to("sum", value, ["cpu:1", "cpu:0", "cpu:1"])
        pairs = zip([value, value], ["cpu:0", "cpu:1"], strict=True)  # any iterable of pairs
        first, second = await batch("sum", pairs)  # type: ignore[arg-type]
        np.testing.assert_array_equal(first, [3.0])
        np.testing.assert_array_equal(second, [3.0])

    async def test_batch_reduce_to_nested_values(self) -> None:
        """batch_reduce_to keeps each value's structure, each leaf on its destinations."""
        strategy = MirroredStrategy(host_devices(3))
        grads = {
            "w": PerReplica([np.full(2, 1.0), np.full(2, 2.0), np.full(2, 3.0)]),
            "b": PerReplica([np.array(1), np.array(2), np.array(4)]),
        }
        nested, single = await strategy.extended.batch_reduce_to(
            "sum", [(grads, ["cpu:0", "cpu:2"]), (grads["w"], "cpu:1")]
        )
        assert set(nested) == {"w", "b"}
        for got in local(strategy, nested["w"]):
            np.testing.assert_array_equal(got, [6.0, 6.0])
        assert {int(got) for got in local(strategy, nested["b"])} == {7}  # shared on the host
        np.testing.assert_array_equal(single, [6.0, 6.0])

    async def test_broadcast_to(self) -> None:
        """broadcast_to places one read-only copy on the destinations."""
        strategy = MirroredStrategy(host_devices(2))
        result = await strategy.extended.broadcast_to(np.arange(3), ["cpu:0", "cpu:1"])
        for got in local(strategy, result):
            np.testing.assert_array_equal(got, [0, 1, 2])
            assert not got.flags.writeable

    @pytest.mark.parametrize(
        ("value", "message"),
        [
            (
                None,
                "the value is None (NoneType); broadcast_to places numbers and arrays: pass a "
                "number or a numpy array instead",
            ),
            (
                "hello",
                "the value is 'hello' (str); broadcast_to places numbers and arrays: pass a number",
            ),
            (
                (1.0, None),
                "the value at [1] is None (NoneType); broadcast_to places numbers and arrays",
            ),
            (np.array([1, None]), "the value is no number or array of numbers (array([1, None]"),
            (
                {"w": PerReplica([1.0, 2.0])},
                "the value at ['w'] is a PerReplica of 2 values, one per replica, but "
                "broadcast_to places one value on every destination: reduce it first "
                "(strategy.extended.reduce_to), or pick one replica's "
                "(strategy.experimental_local_results(value)[i])",
            ),
        ],
        ids=["None", "str", "None-in-a-tuple", "objects", "per-replica"],
    )
    async def test_broadcast_to_refuses_what_it_cannot_place(
        self, value: Any, message: str
    ) -> None:
        """broadcast_to takes one value of numbers and arrays: None, a string, an array of
        objects or a PerReplica is a TypeError saying where it is and what to pass."""
        strategy = MirroredStrategy(host_devices(2))
        with pytest.raises(TypeError) as info:
            await strategy.extended.broadcast_to(value, ["cpu:0", "cpu:1"])
        assert str(info.value).startswith(f"broadcast_to: {message}")

    async def test_broadcast_to_takes_a_mirrored_as_its_value(self) -> None:
        """A Mirrored holds one value on every replica (a reduce_to result, say): broadcast_to
        places that value, as TF reads a mirrored value in cross-replica context."""
        strategy = MirroredStrategy(host_devices(2))
        value = PerReplica([np.array([1.0, 2.0]), np.array([3.0, 4.0])])
        mirrored = await strategy.extended.reduce_to("sum", value, ["cpu:0", "cpu:1"])
        assert isinstance(mirrored, Mirrored)
        placed = await strategy.extended.broadcast_to({"m": mirrored}, "cpu:1")
        assert list(placed) == ["m"]
        assert type(placed["m"]) is np.ndarray
        assert placed["m"].tolist() == [4.0, 6.0]

    async def test_several_destinations_give_mirrored(self) -> None:
        """With several destinations, broadcast_to and reduce_to return a Mirrored with one
        component per destination (as in TF), even where host destinations share one array;
        with one destination, the value itself."""
        strategy = MirroredStrategy(host_devices(3))
        spread = await strategy.extended.broadcast_to(np.arange(2.0), ["cpu:0", "cpu:2"])
        assert isinstance(spread, Mirrored)
        assert len(spread.values) == 2
        assert spread.values[0] is spread.values[1]  # one read-only host array, shared
        value = PerReplica([np.full(2, float(i)) for i in range(3)])
        summed = await strategy.extended.reduce_to("sum", value, value)
        assert isinstance(summed, Mirrored)
        assert len(strategy.experimental_local_results(summed)) == 3
        np.testing.assert_array_equal(summed.values[2], [3.0, 3.0])
        one = await strategy.extended.reduce_to("sum", value, "cpu:1")
        assert type(one) is np.ndarray


class TestPerReplicaOfStructures:
    """A PerReplica whose components are structures (``value_fn`` of
    ``experimental_distribute_values_from_function`` returning a dict) stands for the
    structure of per-replica values, wherever it is in the value a collective takes."""

    @staticmethod
    def values(strategy: MirroredStrategy) -> PerReplica[Any]:
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: {"x": np.full(1, float(ctx.replica_id_in_sync_group)), "y": (np.ones(2),)}
        )

    @pytest.mark.parametrize("replicas", [1, 3])
    async def test_every_cross_replica_call_takes_it_anywhere(self, replicas: int) -> None:
        """reduce, reduce_to and batch_reduce_to reduce it leaf by leaf, and gather gathers
        it, as the value itself and inside a structure alike."""
        strategy = MirroredStrategy(host_devices(replicas))
        value = self.values(strategy)
        extended = strategy.extended
        reduced = {
            "reduce": await strategy.reduce("sum", value),
            "reduce, in a dict": (await strategy.reduce("sum", {"a": value}))["a"],
            "reduce_to": await extended.reduce_to("sum", value, "cpu:0"),
            "reduce_to, in a list": (await extended.reduce_to("sum", [value], "cpu:0"))[0],
            "batch_reduce_to": (await extended.batch_reduce_to("sum", [(value, "cpu:0")]))[0],
        }
        shown = {how: (got["x"].tolist(), got["y"][0].tolist()) for how, got in reduced.items()}
        total = float(sum(range(replicas)))
        assert shown == {how: ([total], [float(replicas)] * 2) for how in reduced}
        gathered = {
            "gather": await strategy.gather(value),
            "gather, in a list": (await strategy.gather([value]))[0],
        }
        shown = {how: (got["x"].tolist(), got["y"][0].tolist()) for how, got in gathered.items()}
        rows = [float(i) for i in range(replicas)]
        assert shown == {how: (rows, [1.0] * 2 * replicas) for how in gathered}

    async def test_errors_name_the_place_inside_it(self) -> None:
        """Replicas' structures that differ name the PerReplica's place; a leaf's error names
        the whole path, through the PerReplica into its components."""
        strategy = MirroredStrategy(host_devices(2))
        keys = PerReplica([{"x": 1.0}, {"z": 1.0}])
        shapes = PerReplica([{"x": np.ones(1)}, {"x": np.ones(2)}])
        calls: list[tuple[type[Exception], Callable[[], Awaitable[Any]]]] = [
            (ValueError, lambda: strategy.reduce("sum", keys)),
            (ValueError, lambda: strategy.reduce("sum", {"a": [keys]})),
            (ValueError, lambda: strategy.extended.reduce_to("sum", {"a": shapes}, "cpu:0")),
            (TypeError, lambda: strategy.gather((PerReplica([{"x": None}] * 2),))),
        ]
        messages = []
        for error, call in calls:
            with pytest.raises(error) as info:
                await call()
            messages.append(str(info.value).partition(";")[0])
        keys_differ = (
            "replica 1's value differs from replica 0's at <root>: keys differ: 'x' only in "
            "replica 0, 'z' only in replica 1"
        )
        assert messages == [
            f"reduce: {keys_differ}",
            f"reduce: in the PerReplica at ['a'][0], {keys_differ}",
            "reduce_to: replica 1's value at ['a']['x'] has shape (2,) and dtype float64, "
            "replica 0's has shape (1,) and dtype float64",
            "every replica passed None (NoneType) to gather at [0]['x']",
        ]


class TestInlineOrWorker:
    """Host work of a collective runs inline when small, in the device's worker when large."""

    @staticmethod
    def record_device_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
        calls: list[str] = []
        real_run = HostDevice.run

        async def run(self: HostDevice, fn: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(f"{self.name} {getattr(fn, '__name__', fn)}")
            return await real_run(self, fn, *args, **kwargs)

        monkeypatch.setattr(HostDevice, "run", run)
        return calls

    async def test_reduce_along_axis(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Each replica's partial sum of a component of INLINE_BYTES runs in its device's
        worker; of a small one, inline."""
        strategy = MirroredStrategy(host_devices(2))
        calls = self.record_device_runs(monkeypatch)
        small = PerReplica([np.ones((4, 2)), np.ones((2, 2))])
        np.testing.assert_array_equal(await strategy.reduce("sum", small, axis=0), [6.0, 6.0])
        assert calls == []
        rows = INLINE_BYTES // 16  # two float64 columns
        big = PerReplica([np.ones((rows, 2)), np.ones((rows, 2))])
        total = await strategy.reduce("sum", big, axis=0)
        np.testing.assert_array_equal(total, [2.0 * rows] * 2)
        assert calls == ["cpu:0 _partial_reduction", "cpu:1 _partial_reduction"]

    async def test_a_large_pack_reduces_in_a_worker(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A pack whose inputs add up to INLINE_BYTES or more (packs that large need a
        bytes_per_pack above the default) is reduced in a device's worker thread; a small one
        inline, on the loop thread."""
        strategy = MirroredStrategy(host_devices(2))
        threads: list[str] = []
        real = _numpy._reduce_leaves_into

        def reduce_leaves_into(*args: Any) -> None:
            threads.append(threading.current_thread().name)
            real(*args)

        monkeypatch.setattr(_numpy, "_reduce_leaves_into", reduce_leaves_into)
        size = INLINE_BYTES // 8 // 8 + 1  # float64: 2 replicas x 4 leaves, over INLINE_BYTES
        options = CommunicationOptions(bytes_per_pack=2 * INLINE_BYTES)

        async def step(size: int) -> Any:
            leaves = [np.full(size, float(replica_id())) for _ in range(4)]  # one pack
            return await replica_context().all_reduce("sum", leaves, options)

        for leaf in await strategy.run(step, args=(size,)):
            np.testing.assert_array_equal(leaf, np.ones(size))
        for leaf in await strategy.run(step, args=(10,)):
            np.testing.assert_array_equal(leaf, np.ones(10))
        assert threads == ["aioreplica cpu:0", threading.current_thread().name]


class TestHostDevice:
    async def test_run_uses_the_device_thread(self) -> None:
        """device.run runs in the device's own worker thread, one per device."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> str:
            return await replica_context().device.run(lambda: threading.current_thread().name)

        names = await strategy.run(step)
        assert names.values == ("aioreplica cpu:0", "aioreplica cpu:1")

    async def test_devices_run_in_parallel(self) -> None:
        """Jobs on two devices run at the same time (each waits for the other)."""
        strategy = MirroredStrategy(host_devices(2))
        meet = threading.Barrier(2, timeout=10)

        async def step() -> int:
            return await replica_context().device.run(meet.wait)

        assert sorted(local(strategy, await strategy.run(step))) == [0, 1]

    async def test_loop_is_not_blocked(self) -> None:
        """While a device job waits, the event loop keeps running other tasks."""
        strategy = MirroredStrategy(host_devices(1))
        released = threading.Event()
        events: list[str] = []

        def job() -> None:
            released.wait(10)
            events.append("job done")

        async def step() -> None:
            await replica_context().device.run(job)

        async with anyio.create_task_group() as group:
            group.start_soon(strategy.run, step)
            await anyio.lowlevel.checkpoint()
            events.append("loop ran")
            released.set()
        assert events == ["loop ran", "job done"]

    async def test_fifo_and_synchronize(self) -> None:
        """Jobs of one device run in submission order; synchronize waits for all of them."""
        device = aioreplica.MirroredStrategy(["cpu:0"]).extended.replica_devices[0]
        submitted: list[int] = []
        order: list[int] = []

        async def submit(i: int) -> None:
            submitted.append(i)  # device.run queues the job in this same step
            await device.run(order.append, i)

        async with anyio.create_task_group() as group:
            for i in range(5):
                group.start_soon(submit, i)
        await device.synchronize()
        assert sorted(submitted) == [0, 1, 2, 3, 4]
        assert order == submitted

    async def test_exceptions_propagate(self) -> None:
        """An exception in a device job comes out of device.run."""
        device = aioreplica.MirroredStrategy(["cpu:0"]).extended.replica_devices[0]

        def boom() -> None:
            raise KeyError("in the worker")

        with pytest.raises(KeyError, match="in the worker"):
            await device.run(boom)

    async def test_cancelled_job_that_has_not_started_is_skipped(self) -> None:
        """Cancelling a wait skips its job if the worker has not started it."""
        device = aioreplica.MirroredStrategy(["cpu:3"]).extended.replica_devices[0]
        gate = threading.Event()
        started = threading.Event()
        ran: list[str] = []

        def first() -> None:
            started.set()
            gate.wait(10)

        async with anyio.create_task_group() as group:
            group.start_soon(device.run, first)
            await anyio.to_thread.run_sync(started.wait, 10)  # the worker is busy with it
            with anyio.move_on_after(0.01):
                await device.run(ran.append, "second")
            gate.set()
        await device.synchronize()
        assert ran == []

    async def test_array_module_and_asarray(self) -> None:
        """A host device's array module is NumPy; asarray makes arrays of lists."""
        device = aioreplica.MirroredStrategy(["cpu:0"]).extended.replica_devices[0]
        assert device.xp is np
        np.testing.assert_array_equal(device.asarray([1, 2]), np.array([1, 2]))


class TestTimeoutScope:
    async def test_a_collective_timeout_bounds_its_own_round_only(self) -> None:
        """After a collective with a timeout, the next rounds use the strategy's own timeout."""
        strategy = MirroredStrategy(host_devices(2), sync_timeout=5)

        async def step() -> Any:
            options = CommunicationOptions(timeout_seconds=0.05)
            # Replica 1 arrives last and completes this round: its timeout watched nothing.
            if replica_id() == 1:
                await anyio.lowlevel.checkpoint()
            await replica_context().all_reduce("sum", np.zeros(1), options=options)
            if replica_id() == 0:
                await anyio.sleep(0.1)  # longer than that timeout, far within sync_timeout
            return await replica_context().all_reduce("sum", np.ones(1))

        np.testing.assert_array_equal(await strategy.run(step), [2.0])


#: A user's context variable, set by replicas and read by their device work.
user_var: contextvars.ContextVar[str] = contextvars.ContextVar("user_var", default="unset")


def replica_and_user_var() -> str:
    """What device work sees of its caller's context: the replica and ``user_var``."""
    replica = aioreplica.get_replica_context()
    assert replica is not None
    return (
        f"replica {replica.replica_id_in_sync_group} of {replica.num_replicas_in_sync}, "
        f"{user_var.get()}"
    )


class TestDeviceWorkSeesTheCallersContext:
    """Work handed to a device thread runs in a copy of the caller's context (as
    ``anyio.to_thread.run_sync`` does): it sees the replica context and the caller's context
    variables, and what it sets stays inside it."""

    async def test_run_sees_the_replica_and_its_context_variables(self) -> None:
        """Inside device.run, replica i's work sees replica i (of 3) and i's value of a
        user ContextVar."""
        strategy = MirroredStrategy(host_devices(3))

        async def step() -> str:
            user_var.set(f"set by replica {replica_id()}")
            return await replica_context().device.run(replica_and_user_var)

        result = await strategy.run(step)
        assert local(strategy, result) == (
            "replica 0 of 3, set by replica 0",
            "replica 1 of 3, set by replica 1",
            "replica 2 of 3, set by replica 2",
        )

    async def test_compute_on_the_worker_sees_the_replica(self) -> None:
        """device.compute above the inline threshold (in the worker) sees the caller's
        context, as it does inline."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> str:
            user_var.set(f"set by replica {replica_id()}")
            device = replica_context().device
            inline = await device.compute(0, replica_and_user_var)
            on_worker = await device.compute(INLINE_BYTES, replica_and_user_var)
            return f"inline: {inline}; on the worker: {on_worker}"

        result = await strategy.run(step)
        assert local(strategy, result) == (
            "inline: replica 0 of 2, set by replica 0; on the worker: replica 0 of 2, set by "
            "replica 0",
            "inline: replica 1 of 2, set by replica 1; on the worker: replica 1 of 2, set by "
            "replica 1",
        )

    async def test_a_change_inside_stays_inside(self) -> None:
        """A ContextVar set inside device.run is not seen by the caller afterwards, nor by the
        next job on the same device thread."""
        device = MirroredStrategy(["cpu:0"]).extended.replica_devices[0]
        user_var.set("the caller's")

        def change() -> str:
            user_var.set("set inside the job")
            return user_var.get()

        seen = [await device.run(change), user_var.get(), await device.run(user_var.get)]
        assert seen == ["set inside the job", "the caller's", "the caller's"]

    async def test_a_collectives_worker_jobs_see_the_callers_context(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The blocks of a large host all_reduce, split over the devices' threads, run in the
        caller's context too: every path to a device thread behaves alike."""
        seen: list[tuple[str, str]] = []
        real_reduce_range = _hostreduce.reduce_range

        def reduce_range(*args: Any) -> None:
            seen.append((threading.current_thread().name, user_var.get()))
            real_reduce_range(*args)

        monkeypatch.setattr(_numpy, "reduce_range", reduce_range)
        monkeypatch.setattr(_numpy, "_cores", lambda: 2)
        strategy = MirroredStrategy(host_devices(2))
        user_var.set("the caller's")
        size = INLINE_BYTES // 4  # each replica's array alone is too big to reduce inline
        value = PerReplica([np.ones(size, np.float32), np.ones(size, np.float32)])
        total = await strategy.reduce("sum", value)
        np.testing.assert_array_equal(total, np.full(size, 2.0, np.float32))
        assert sorted(seen) == [
            ("aioreplica cpu:0", "the caller's"),
            ("aioreplica cpu:1", "the caller's"),
        ]


class TestVariablesInReplicaCollectives:
    """A variable passed to a collective in replica context is read as TF reads it there:
    each replica contributes its own copy."""

    async def test_each_replica_contributes_its_copy(self) -> None:
        """TF's ReplicaCtxAllReduceTest.testSyncOnReadVariableInput, and the same for a
        mirrored variable, an ordinary one, and one inside a structure."""
        strategy = MirroredStrategy(host_devices(3))
        with strategy.scope():
            mine = aioreplica.Variable(
                0.0, synchronization="on_read", aggregation="only_first_replica"
            )
            shared = aioreplica.Variable(np.array([1.0, 2.0]))
        ordinary = aioreplica.Variable(5.0)

        async def step() -> Any:
            ctx = replica_context()
            await mine.assign(3.0 * replica_id())
            return (
                await ctx.all_reduce("sum", mine),
                await ctx.all_reduce("sum", {"w": shared, "n": ordinary}),
                await ctx.broadcast(mine, source_replica=2),
                await ctx.all_gather(shared, axis=0),
            )

        for summed, nested, sent, gathered in local(strategy, await strategy.run(step)):
            assert summed == 9.0
            assert nested["w"].tolist() == [3.0, 6.0]
            assert nested["n"] == 15.0
            assert sent == 6.0
            assert gathered.tolist() == [1.0, 2.0] * 3

    async def test_replicas_that_pass_different_variables_or_arrays(self) -> None:
        """Each replica's variable gives that replica's copy, whichever variable it is, beside
        plain values from others."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            a = aioreplica.Variable(0.0, synchronization="on_read", aggregation="sum")
            b = aioreplica.Variable(0.0, synchronization="on_read", aggregation="sum")

        async def step() -> Any:
            ctx = replica_context()
            await a.assign(1.0 + replica_id())
            await b.assign(10.0 + replica_id())
            return (
                await ctx.all_reduce("sum", a if replica_id() == 0 else b),
                await ctx.all_reduce("sum", a if replica_id() == 0 else np.float64(100.0)),
            )

        assert local(strategy, await strategy.run(step)) == ((12.0, 101.0), (12.0, 101.0))

    @pytest.mark.parametrize("devices", [2, 3], ids=["other copies", "as many copies"])
    async def test_a_variable_of_another_strategy(self, devices: int) -> None:
        """Another strategy's variable is refused, whatever its number of copies, naming it."""
        strategy = MirroredStrategy(host_devices(3))
        other = MirroredStrategy(host_devices(devices))
        with other.scope():
            v = aioreplica.Variable(1.0, name="theirs")

        async def step() -> Any:
            return await replica_context().all_reduce("sum", {"v": v})

        with pytest.raises(
            ValueError,
            match=r"all_reduce: the variable at \['v'\] \('theirs'\) belongs to another "
            "strategy; pass a variable of this strategy, or an ordinary one",
        ):
            await strategy.run(step)


class TestLeavesThatAreNotNumbers:
    """None, strings and other objects in a collective name the replica, the operation and
    what collectives take, before anything is reduced."""

    @staticmethod
    async def call(operation: str, value: Any) -> Any:
        replica = replica_context()
        if operation == "all_reduce":
            return await replica.all_reduce("sum", value)
        if operation == "all_gather":
            return await replica.all_gather(value, axis=0)
        if operation == "broadcast":
            return await replica.broadcast(value)
        assert operation == "reduce_scatter"
        return await replica.reduce_scatter("sum", value, axis=0)

    @pytest.mark.parametrize(
        "operation", ["all_reduce", "all_gather", "broadcast", "reduce_scatter"]
    )
    @pytest.mark.parametrize(
        ("bad", "description"), [(None, "None (NoneType)"), ("abc", "'abc' (str)")]
    )
    async def test_one_replica_passes_it(self, operation: str, bad: Any, description: str) -> None:
        """Replica 1 passing None or a string where replica 0 passes an array is named."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            return await self.call(operation, bad if replica_id() == 1 else np.ones(2))

        with pytest.raises(TypeError) as info:
            await strategy.run(step)
        message = str(info.value)
        assert message.startswith(f"replica 1 passed {description} to {operation}; ")
        assert "collectives take numbers and arrays" in message
        assert "replica 0" not in message

    @pytest.mark.parametrize("bad", [None, "abc", b"abc", object()])
    async def test_every_replica_passes_it(self, bad: Any) -> None:
        """The same non-number from every replica (regrouped as one plain value) is named
        as every replica's, with its key path inside the structure."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            return await replica_context().all_reduce("sum", {"loss": np.ones(1), "note": bad})

        with pytest.raises(TypeError) as info:
            await strategy.run(step)
        assert str(info.value).startswith(
            f"every replica passed {bad!r:.60} ({type(bad).__name__}) to all_reduce at ['note']; "
            "collectives take numbers and arrays"
        )

    async def test_per_replica_nones_in_cross_replica_calls(self) -> None:
        """strategy.reduce, gather, reduce_to and batch_reduce_to of PerReplica([None, None])
        name both replicas and the operation."""
        strategy = MirroredStrategy(host_devices(2))
        nones = PerReplica([None, None])
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: strategy.reduce("sum", nones),
            lambda: strategy.gather(nones),
            lambda: strategy.extended.reduce_to("sum", nones, "cpu:0"),
            lambda: strategy.extended.batch_reduce_to("sum", [(nones, "cpu:0")]),
        ]
        messages = []
        for call in calls:
            with pytest.raises(TypeError) as info:
                await call()
            messages.append(str(info.value).partition(";")[0])
        assert messages == [
            "replicas 0 and 1 passed None (NoneType) to reduce",
            "replicas 0 and 1 passed None (NoneType) to gather",
            "replicas 0 and 1 passed None (NoneType) to reduce_to",
            "replicas 0 and 1 passed None (NoneType) to batch_reduce_to at [0]",
        ]

    async def test_replicas_passing_different_non_numbers_are_each_named(self) -> None:
        """Each kind of bad value is named with the replicas that passed it."""
        strategy = MirroredStrategy(host_devices(4))
        value = PerReplica([1.0, None, "abc", None])
        with pytest.raises(TypeError) as info:
            await strategy.reduce("sum", value)
        assert str(info.value).startswith(
            "replicas 1 and 3 passed None (NoneType), replica 2 passed 'abc' (str) to reduce; "
        )
