"""MirroredStrategy: construction, run() arguments and results, misuse."""

from __future__ import annotations

import collections
import math
import re
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

import aioreplica
from aioreplica import Mirrored, MirroredStrategy, PerReplica, Variable, get_replica_context
from aioreplica.testing import replica_context, replica_id

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = pytest.mark.anyio


Pair = collections.namedtuple("Pair", ["x", "y"])


class TestConstruction:
    def test_devices_are_canonical(self) -> None:
        """TF spellings canonicalise; the replica count follows the device list."""
        strategy = MirroredStrategy(["/device:CPU:0", "CPU:1", "/cpu:2"])
        assert strategy.devices == ("cpu:0", "cpu:1", "cpu:2")
        assert strategy.num_replicas_in_sync == 3
        assert strategy.extended.worker_devices == ("cpu:0", "cpu:1", "cpu:2")
        assert [d.name for d in strategy.extended.replica_devices] == list(strategy.devices)
        assert strategy.extended.parameter_devices == strategy.devices
        assert repr(strategy) == "MirroredStrategy(devices=['cpu:0', 'cpu:1', 'cpu:2'])"

    def test_one_process_is_chief_of_itself(self) -> None:
        """As TF's MirroredStrategy: one program, which checkpoints, summarises and inits."""
        extended = MirroredStrategy(["cpu:0", "cpu:1"]).extended
        roles = (
            extended.experimental_between_graph,
            extended.should_checkpoint,
            extended.should_save_summary,
            extended.experimental_should_init,
        )
        assert roles == (False, True, True, True)
        assert MirroredStrategy(["cpu:0"]).cluster_resolver is None  # TF's: no cluster

    def test_default_is_one_host_device(self) -> None:
        """devices=None means one replica on cpu:0."""
        assert MirroredStrategy().devices == ("cpu:0",)

    def test_unknown_device_lists_valid_names(self) -> None:
        """An unknown device name is a ValueError that says what is valid."""
        with pytest.raises(ValueError, match=r"unknown device 'tpu:0': valid names are .*'cpu:0'"):
            MirroredStrategy(["cpu:0", "tpu:0"])

    def test_duplicate_device_rejected(self) -> None:
        """The same device twice, in any spelling, is a ValueError naming both positions."""
        with pytest.raises(ValueError, match=r"'cpu:1' appears twice \(positions 1 and 2\)"):
            MirroredStrategy(["cpu:0", "cpu:1", "/device:CPU:1"])

    @pytest.mark.parametrize("timeout", [0, -1, math.nan])
    def test_bad_sync_timeout(self, timeout: Any) -> None:
        """sync_timeout must be a positive number of seconds."""
        with pytest.raises(ValueError, match="sync_timeout must be a positive number"):
            MirroredStrategy(["cpu:0"], sync_timeout=timeout)

    @pytest.mark.parametrize("timeout", [math.inf, 10**400], ids=["inf", "10**400"])
    def test_sync_timeout_too_large_for_a_float(self, timeout: Any) -> None:
        """An infinite sync_timeout, or an int too large for a float, is a ValueError saying
        that None means no timeout (not an OverflowError, nor a timeout that never ends)."""
        shown = re.escape(f"got {timeout!r:.60}")
        with pytest.raises(
            ValueError,
            match=(
                rf"^sync_timeout must be a positive number of seconds or None, {shown}, which "
                "is infinite or too large: for no timeout pass None$"
            ),
        ):
            MirroredStrategy(["cpu:0"], sync_timeout=timeout)

    def test_slow_merge_warning_too_large_for_a_float(self) -> None:
        """slow_merge_warning=10**400 is a ValueError, as an infinite one is."""
        with pytest.raises(ValueError, match=r"^slow_merge_warning must be a positive, finite"):
            MirroredStrategy(["cpu:0"], slow_merge_warning=10**400)

    @pytest.mark.parametrize("timeout", ["5", True, [1]])
    def test_sync_timeout_of_another_type(self, timeout: Any) -> None:
        """A sync_timeout that is no number (a string, a bool, a list) is a TypeError."""
        shown = re.escape(f"got {type(timeout).__name__} {timeout!r}")
        with pytest.raises(
            TypeError, match=f"^sync_timeout must be a positive number of seconds or None, {shown}$"
        ):
            MirroredStrategy(["cpu:0"], sync_timeout=timeout)

    def test_bad_interleave(self) -> None:
        """interleave must be 'ordered' or 'random'."""
        with pytest.raises(ValueError, match=r"interleave must be one of \('ordered', 'random'\)"):
            MirroredStrategy(["cpu:0"], interleave="sorted")  # type: ignore[arg-type]

    @pytest.mark.parametrize("seed", [True, "7", 1.5])
    def test_seed_must_be_an_int(self, seed: Any) -> None:
        """A seed that is no int (a bool, a string) is refused, not hashed into one."""
        shown = re.escape(f"got {type(seed).__name__} {seed!r}")
        with pytest.raises(TypeError, match=f"seed must be an int or None, {shown}"):
            MirroredStrategy(["cpu:0"], interleave="random", seed=seed)

    def test_numpy_numbers_are_seconds(self) -> None:
        """Timeouts computed with NumPy (a float32, an int64) are seconds like any number."""
        seconds: Any = np.float32(2.5), np.int64(30)  # typed float: taken at run time
        strategy = MirroredStrategy(
            ["cpu:0"], sync_timeout=seconds[0], slow_merge_warning=seconds[1]
        )
        assert (strategy.sync_timeout, strategy.slow_merge_warning) == (2.5, 30.0)
        assert type(strategy.sync_timeout) is float

    def test_a_numpy_integer_seed_is_an_int(self) -> None:
        strategy = MirroredStrategy(["cpu:0"], interleave="random", seed=np.int64(7))
        assert strategy.seed == 7
        assert type(strategy.seed) is int

    def test_seed_needs_random_interleave(self) -> None:
        """A seed with interleave='ordered' is refused rather than ignored."""
        with pytest.raises(ValueError, match="seed only applies to interleave='random'"):
            MirroredStrategy(["cpu:0"], seed=3)


class TestDeviceListMistakes:
    """``devices`` is a list of device names (as in TF); other things say how to write one."""

    @pytest.mark.parametrize("count", [1, 4])
    def test_a_replica_count(self, count: int) -> None:
        """A number of replicas is refused with the list that lays them out on this host."""
        with pytest.raises(TypeError) as info:
            MirroredStrategy(count)  # type: ignore[arg-type]
        assert str(info.value) == (
            f"devices must be a list of device names, got the int {count}; for {count} "
            f"replica{'s' if count > 1 else ''} on this host write "
            f'devices=[f"cpu:{{i}}" for i in range({count})]'
        )

    def test_a_single_name(self) -> None:
        """One device name as a string is refused with the list to write."""
        with pytest.raises(TypeError, match=r"got the string 'cpu:0'; write \['cpu:0'\]$"):
            MirroredStrategy("cpu:0")

    def test_names_in_one_string(self) -> None:
        """Several names in one string are split in the advice."""
        with pytest.raises(
            TypeError, match=r"got the string 'cpu:0, cpu:1'; write \['cpu:0', 'cpu:1'\]$"
        ):
            MirroredStrategy("cpu:0, cpu:1")

    def test_a_string_that_names_no_device(self) -> None:
        """A string that is no device name is not echoed back as advice."""
        with pytest.raises(TypeError) as info:
            MirroredStrategy("host")
        message = str(info.value)
        assert message.startswith("devices must be a list of device names, got the string 'host'")
        assert "write ['host']" not in message
        assert "such as ['cpu:0', 'cpu:1']" in message

    def test_bytes(self) -> None:
        """A bytes name is refused whole (not taken apart into ints)."""
        with pytest.raises(TypeError, match=r"got the bytes b'cpu:0'; write \['cpu:0'\]$"):
            MirroredStrategy(b"cpu:0")  # type: ignore[arg-type]

    def test_a_device_object(self) -> None:
        """One device object is refused with the list to write."""
        device = MirroredStrategy(["cpu:0"]).extended.replica_devices[0]
        with pytest.raises(TypeError, match=r"got the device <HostDevice cpu:0>; write \[device\]"):
            MirroredStrategy(device)  # type: ignore[arg-type]

    def test_a_set(self) -> None:
        """A set has no order, and replica ids follow the list's order: refused."""
        with pytest.raises(TypeError, match=r"got a set, which has no order; replica ids"):
            MirroredStrategy({"cpu:0", "cpu:1"})  # type: ignore[arg-type]

    def test_any_other_object(self) -> None:
        """Something that is not iterable at all is named with its type."""
        with pytest.raises(
            TypeError,
            match=r"^devices must be a list of device names such as \['cpu:0', 'cpu:1'\], "
            r"got the float 2\.0",
        ):
            MirroredStrategy(2.0)  # type: ignore[arg-type]

    def test_other_iterables_of_names_still_work(self) -> None:
        """A generator or a tuple of names is a list of names."""
        assert MirroredStrategy(f"cpu:{i}" for i in range(2)).devices == ("cpu:0", "cpu:1")  # type: ignore[arg-type]
        assert MirroredStrategy(("cpu:1",)).devices == ("cpu:1",)


class TestDistributeDatasetArguments:
    def test_a_string_is_not_a_dataset(self) -> None:
        """A string would be split into characters: refused."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with pytest.raises(TypeError, match=r"^a dataset must be an iterable .*got the str 'abc'"):
            strategy.distribute_dataset("abc")

    @pytest.mark.parametrize("flag", ["no", 1, None])
    def test_drop_remainder_must_be_a_bool(self, flag: Any) -> None:
        """A truthy string such as 'no' would drop batches: refused."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with pytest.raises(
            TypeError, match=rf"^drop_remainder must be True or False, got {re.escape(repr(flag))}$"
        ):
            strategy.distribute_dataset([], drop_remainder=flag)

    def test_prefetch_must_not_be_a_bool(self) -> None:
        """prefetch=True is not taken for 1."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with pytest.raises(TypeError, match=r"^prefetch must be an int >= 0, got True$"):
            strategy.distribute_dataset([], prefetch=True)

    async def test_numpy_integers_are_sizes(self) -> None:
        """A batch size and a prefetch depth computed with NumPy are ints like any."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        batches = aioreplica.batched(np.arange(8), np.int64(4))
        dataset = strategy.distribute_dataset(batches, prefetch=np.int64(1))
        got = [[v.tolist() for v in element.values] async for element in dataset]
        assert got == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


class TestRunArguments:
    async def test_per_replica_and_mirrored_are_unwrapped(self) -> None:
        """Each replica gets its own component of PerReplica and Mirrored arguments."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        seen: list[tuple[int, Any, Any, Any]] = []

        async def step(a: int, pair: Pair, *, scale: float, label: str) -> None:
            seen.append((replica_id(), a, pair, (scale, label)))

        await strategy.run(
            step,
            args=(PerReplica([10, 20]), Pair(PerReplica(["x0", "x1"]), 5)),
            kwargs={"scale": Mirrored([0.5, 0.5]), "label": "same"},
        )
        assert sorted(seen) == [
            (0, 10, Pair("x0", 5), (0.5, "same")),
            (1, 20, Pair("x1", 5), (0.5, "same")),
        ]

    async def test_flat_positional_arguments(self) -> None:
        """Positional leaves only (the common case): each replica gets its components of the
        distributed ones and the very same object for the others."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        label = np.array(["same"])
        seen: list[tuple[int, Any, Any, bool]] = []

        async def step(a: int, b: str, c: float, d: Any) -> None:
            seen.append((replica_id(), a, (b, c), d is label))

        await strategy.run(step, args=(PerReplica([10, 20]), "b", Mirrored([0.5, 0.5]), label))
        assert sorted(seen) == [(0, 10, ("b", 0.5), True), (1, 20, ("b", 0.5), True)]

    async def test_plain_arguments_are_shared(self) -> None:
        """Arguments without distributed values reach every replica as they are."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
        payload = {"weights": [1.0, 2.0]}
        seen: list[bool] = []

        async def step(tree: dict[str, list[float]]) -> None:
            seen.append(tree is payload)

        await strategy.run(step, args=(payload,))
        assert seen == [True, True, True]

    async def test_wrong_number_of_components(self) -> None:
        """A PerReplica with the wrong length names its place in the arguments."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])

        async def step(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("must not run")

        with pytest.raises(ValueError, match=r"args\[1\]\['w'\] is a PerReplica of 2 values, .*3"):
            await strategy.run(step, args=(1, {"w": PerReplica([1, 2])}))
        with pytest.raises(ValueError, match=r"args\[1\] is a PerReplica of 2 values, .*3"):
            await strategy.run(step, args=(1, PerReplica([1, 2])))
        with pytest.raises(ValueError, match=r"kwargs\['b'\] is a Mirrored of 4 values"):
            await strategy.run(step, kwargs={"b": Mirrored([1, 1, 1, 1])})

    async def test_bad_fn_args_kwargs(self) -> None:
        """A non-callable fn, a string as args, or non-mapping kwargs are TypeErrors."""
        strategy = MirroredStrategy(["cpu:0"])
        with pytest.raises(TypeError, match="fn must be callable, got int"):
            await strategy.run(3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"args must be a tuple .* write args=\(value,\)"):
            await strategy.run(print, args="abc")
        with pytest.raises(TypeError, match="kwargs must be a mapping or None, got list"):
            await strategy.run(print, kwargs=[1])  # type: ignore[arg-type]

    @pytest.mark.parametrize("args", [b"ab", bytearray(b"ab")])
    async def test_bytes_are_no_args(self, args: Any) -> None:
        """bytes as args would be unpacked into int arguments: refused as a string is."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        calls: list[tuple[Any, ...]] = []

        async def step(*given: Any) -> None:
            calls.append(given)

        shown = re.escape(
            f"got {type(args).__name__} {args!r}; for one argument write args=(value,)"
        )
        with pytest.raises(TypeError, match=f"^args must be a tuple of arguments, {shown}$"):
            await strategy.run(step, args=args)
        await strategy.run(step, args=(args,))
        assert calls == [(args,), (args,)]


class TestRunResults:
    async def test_differing_results_become_per_replica(self) -> None:
        """Results that differ between replicas come back as PerReplica, nested ones leafwise."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        shared = object()

        async def step() -> dict[str, Any]:
            return {"id": replica_id(), "shared": shared, "pair": (replica_id() * 2, "c")}

        result = await strategy.run(step)
        assert result["id"].values == (0, 1)
        assert result["shared"] is shared
        assert result["pair"][0].values == (0, 2)
        assert result["pair"][1] == "c"

    async def test_a_class_defined_in_the_step(self) -> None:
        """A namedtuple made inside the step is a new class per replica: the mismatch names
        the replicas and says how to define it once."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])

        async def step() -> Any:
            Out = collections.namedtuple("Out", ["loss", "step"])
            return Out(0.5, replica_id())

        with pytest.raises(TypeError) as info:
            await strategy.run(step)
        message = str(info.value)
        assert message.startswith(
            "replica 1's value differs from replica 0's at <root>: replica 0 has an Out of 2 "
            "items, replica 1 an Out of 2 items: two different classes, both test_strategy.Out"
        )
        assert "define it once, at module level" in message

    async def test_one_replica_returns_the_value(self) -> None:
        """With one replica the result is the value itself."""
        strategy = MirroredStrategy(["cpu:0"])

        async def step() -> list[int]:
            return [1, 2]

        assert await strategy.run(step) == [1, 2]

    async def test_plain_function_runs_per_replica(self) -> None:
        """A plain (non-async) function runs once per replica in its replica context."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        assert (await strategy.run(lambda x: x + replica_id(), args=(5,))).values == (5, 6)

    async def test_function_returning_an_awaitable(self) -> None:
        """A plain function that returns an awaitable has it awaited, like a coroutine fn."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])

        async def inner(x: int) -> int:
            ctx = get_replica_context()
            assert ctx is not None
            merged: int = await ctx.merge_call(lambda s, v: sum(v.values), args=(x + replica_id(),))
            return merged

        assert await strategy.run(lambda: inner(1)) == 3

    async def test_experimental_local_results(self) -> None:
        """Local results are the components of a distributed value; a plain value stands
        for the same value on every replica."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        assert strategy.experimental_local_results(PerReplica([1, 2])) == (1, 2)
        assert strategy.experimental_local_results(7) == (7, 7)

    @pytest.mark.parametrize(
        ("returned", "each"),
        [
            (lambda r: {"a": 1.0, "b": r}, lambda r: {"a": 1.0, "b": r}),
            (lambda r: [1.0, r], lambda r: [1.0, r]),
            (lambda r: (1.0, (r, {"c": r * 2})), lambda r: (1.0, (r, {"c": r * 2}))),
            (lambda r: {"a": 1, "b": "text"}, lambda r: {"a": 1, "b": "text"}),
        ],
        ids=["dict", "list", "nested", "no arrays"],
    )
    async def test_local_results_of_a_structure_are_one_structure_per_replica(
        self, returned: Callable[[int], Any], each: Callable[[int], Any]
    ) -> None:
        """TF's StrategyLocalResultTest: a structure run() returned gives each replica's own
        structure, plain leaves repeated."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
        result = await strategy.run(lambda: returned(replica_id()))
        assert strategy.experimental_local_results(result) == tuple(each(r) for r in range(3))

    async def test_local_results_of_what_every_replica_shares(self) -> None:
        """A host all_reduce gives every replica one shared array, which run() returns once:
        its local results are still one per replica (TF's testAllReduceSum), as are those of
        a variable in a structure (its copies)."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            v = Variable(np.zeros(2), synchronization="on_read", aggregation="sum")

        async def step() -> Any:
            await v.assign(np.full(2, float(replica_id())))
            return await replica_context().all_reduce("sum", np.ones(2)), {"v": v}

        results = strategy.experimental_local_results(await strategy.run(step))
        assert [summed.tolist() for summed, _ in results] == [[2.0, 2.0]] * 2
        assert [holder["v"].tolist() for _, holder in results] == [[0.0, 0.0], [1.0, 1.0]]

    async def test_local_results_refuse_a_nested_value_of_another_length(self) -> None:
        """A distributed value alone gives what it holds (as TF's); in a structure, which is
        cut into one per replica, one of another length is refused."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        assert strategy.experimental_local_results(Mirrored([1, 1, 1])) == (1, 1, 1)
        with pytest.raises(
            ValueError,
            match=r"^experimental_local_results: the value at \['a'\] holds 3 values, but "
            "this strategy has 2 local replicas$",
        ):
            strategy.experimental_local_results({"a": PerReplica([1, 2, 3])})

    async def test_local_results_of_an_ordinary_variable(self) -> None:
        """An ordinary variable's one copy stands for every replica, alone or nested; a
        variable of the strategy gives its copies."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        ordinary = Variable(1.0)
        with strategy.scope():
            mirrored = Variable(2.0)
        assert strategy.experimental_local_results(ordinary) == (1.0, 1.0)
        assert strategy.experimental_local_results([ordinary, mirrored]) == ([1.0, 2.0],) * 2
        assert strategy.experimental_local_results(mirrored) == mirrored.values


class TestRunMisuse:
    async def test_run_inside_a_replica(self) -> None:
        """run() inside a replica raises RuntimeError naming the replica."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])

        async def step() -> None:
            await strategy.run(lambda: None)

        with pytest.raises(RuntimeError, match=r"run\(\) was called inside replica (\d)") as info:
            await strategy.run(step)
        replica = re.search(r"inside replica (\d)", str(info.value))
        assert replica is not None
        assert info.value.__notes__[0].startswith(f"raised in replica {replica[1]} of 2")

    async def test_run_inside_merge_fn(self) -> None:
        """TF's testCallAndMergeExceptions: merge_fn may run the strategy's replicas again,
        whose results and exceptions come out as run()'s do; another strategy's run() there
        is refused, as mixing strategies is."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        inner = MirroredStrategy(["cpu:0"])

        async def again(s: MirroredStrategy) -> Any:
            return s.experimental_local_results(await s.run(lambda: replica_id() * 10))

        async def step() -> Any:
            return await replica_context().merge_call(again)

        assert strategy.experimental_local_results(await strategy.run(step)) == ((0, 10),) * 2

        async def raises(s: MirroredStrategy) -> None:
            await s.run(lambda: 1 / 0)

        with pytest.raises(ZeroDivisionError):
            await strategy.run(lambda: replica_context().merge_call(raises))

        async def mixes(s: MirroredStrategy) -> None:
            await inner.run(lambda: None)

        with pytest.raises(RuntimeError, match=r"run\(\) of .* was called in the scope of"):
            await strategy.run(lambda: replica_context().merge_call(mixes))

    def test_run_outside_an_event_loop(self) -> None:
        """Driving run() without a running loop says how to run it."""
        strategy = MirroredStrategy(["cpu:0"])
        coro = strategy.run(lambda: None)
        with pytest.raises(RuntimeError, match=r"inside a running asyncio or trio event loop"):
            coro.send(None)
        coro.close()


class TestConcurrentRuns:
    async def test_two_runs_of_one_strategy_stay_apart(self) -> None:
        """Two concurrent runs of the same strategy have their own rounds and results."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
        results: dict[str, Any] = {}

        async def step(tag: str) -> tuple[str, int]:
            ctx = get_replica_context()
            assert ctx is not None
            total = 0
            for i in range(5):
                await anyio.lowlevel.checkpoint()
                total += await ctx.merge_call(
                    lambda s, v: sum(s.experimental_local_results(v)),
                    args=(i * (replica_id() + 1),),
                )
            return tag, total

        async def one(tag: str) -> None:
            results[tag] = await strategy.run(step, args=(tag,))

        async with anyio.create_task_group() as group:
            group.start_soon(one, "a")
            group.start_soon(one, "b")
        assert results == {"a": ("a", 60), "b": ("b", 60)}
        s = strategy.statistics()
        assert (s.runs_active, s.replicas_waiting, s.merge_rounds_completed) == (0, 0, 10)


class TestAsInTF:
    """What a ``tf.distribute`` user types, and where aioreplica used to differ from TF."""

    async def test_the_default_strategys_scope_keeps_the_default_replica_context(self) -> None:
        """TF's ``testScopeMostlyNoOp``."""
        default = aioreplica.get_strategy()
        replica_context = get_replica_context()
        with default.scope() as entered:
            assert entered is default
            assert get_replica_context() is replica_context
            assert not aioreplica.in_cross_replica_context()
            assert aioreplica.get_cross_replica_context() is None
            assert aioreplica.get_strategy() is default
            assert not aioreplica.has_strategy()
            assert type(aioreplica.Variable(1.0)) is aioreplica.Variable

    async def test_get_cross_replica_context(self) -> None:
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        seen: list[Any] = []

        def merge(s: MirroredStrategy) -> None:
            seen.append(aioreplica.get_cross_replica_context())

        async def step() -> None:
            seen.append(aioreplica.get_cross_replica_context())
            await aioreplica.get_replica_context().merge_call(merge)  # type: ignore[union-attr]

        assert aioreplica.get_cross_replica_context() is None
        with strategy.scope():
            assert aioreplica.get_cross_replica_context() is strategy
        await strategy.run(step)
        assert seen == [None, None, strategy]

    async def test_experimental_distribute_dataset_is_distribute_dataset(self) -> None:
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        data = aioreplica.batched(np.arange(6.0), 4)
        tf_name = [
            [list(v) for v in x.values]
            async for x in strategy.experimental_distribute_dataset(data)
        ]
        ours = [[list(v) for v in x.values] async for x in strategy.distribute_dataset(data)]
        assert tf_name == ours == [[[0.0, 1.0], [2.0, 3.0]], [[4.0], [5.0]]]
        with pytest.raises(TypeError):
            strategy.experimental_distribute_dataset("abc")

    async def test_experimental_distribute_datasets_from_function_is_the_same(self) -> None:
        """TF's older name experimental_distribute_datasets_from_function is
        distribute_datasets_from_function: the same batches, the same refusals."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        contexts: list[tuple[int, int]] = []

        def dataset_fn(context: aioreplica.InputContext) -> Any:
            contexts.append((context.num_input_pipelines, context.num_replicas_in_sync))
            return aioreplica.batched(np.arange(6.0), 2)

        tf_name = [
            [list(v) for v in x.values]
            async for x in strategy.experimental_distribute_datasets_from_function(dataset_fn)
        ]
        ours = [
            [list(v) for v in x.values]
            async for x in strategy.distribute_datasets_from_function(dataset_fn)
        ]
        assert tf_name == ours == [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], []]]
        assert contexts == [(1, 2), (1, 2)]
        with pytest.raises(TypeError, match=r"^dataset_fn must be callable"):
            strategy.experimental_distribute_datasets_from_function(5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="prefetch"):
            strategy.experimental_distribute_datasets_from_function(dataset_fn, prefetch=-1)

    async def test_reduce_to_a_variables_devices(self) -> None:
        """``reduce_to(SUM, grad, destinations=var)``, the standard optimizer pattern."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            v = aioreplica.Variable(np.zeros(2))
        grad = PerReplica([np.ones(2), np.full(2, 3.0)])
        reduced = await strategy.extended.reduce_to("sum", grad, destinations=v)
        assert isinstance(reduced, Mirrored)
        assert [list(c) for c in reduced.values] == [[4.0, 4.0], [4.0, 4.0]]
        (batched,) = await strategy.extended.batch_reduce_to("mean", [(grad, v)])
        assert [list(c) for c in batched.values] == [[2.0, 2.0], [2.0, 2.0]]

    async def test_variables_as_values(self) -> None:
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            mirrored = aioreplica.Variable(np.array([1.0, 2.0]), name="w")
            metric = aioreplica.Variable(
                np.array([1.0, 2.0]), synchronization="on_read", aggregation="sum"
            )

        async def step() -> None:
            await metric.assign_add(np.full(2, replica_id() + 1.0))

        await strategy.run(step)  # copies [2, 3] and [3, 4]
        assert list(await strategy.reduce("mean", mirrored)) == [1.0, 2.0]
        assert list(await strategy.reduce("max", mirrored)) == [1.0, 2.0]
        assert list(await strategy.reduce("sum", metric)) == [5.0, 7.0]
        assert list((await strategy.reduce("mean", {"m": metric}))["m"]) == [2.5, 3.5]
        to_one = await strategy.extended.reduce_to("mean", mirrored, destinations="cpu:1")
        assert list(to_one) == [1.0, 2.0]
        pairs = [(metric, mirrored), (mirrored, "cpu:0")]
        summed, mean = await strategy.extended.batch_reduce_to("max", pairs)
        assert [list(c) for c in summed.values] == [[3.0, 4.0], [3.0, 4.0]]
        assert list(mean) == [1.0, 2.0]
        plain = aioreplica.Variable(np.array([5.0]))
        assert list(await strategy.reduce("sum", PerReplica([plain.value(), plain.value()]))) == [
            10.0
        ]

    async def test_variable_created_in_scope(self) -> None:
        """TF's ``extended.variable_created_in_scope``: the strategy's own variables only."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        other = MirroredStrategy(["cpu:0"])
        with strategy.scope():
            mirrored = aioreplica.Variable(1.0)
            metric = aioreplica.Variable(0.0, synchronization="on_read", aggregation="sum")
        with other.scope():
            others = aioreplica.Variable(1.0)
        created = strategy.extended.variable_created_in_scope
        plain = aioreplica.Variable(1.0)
        assert [created(v) for v in (mirrored, metric, others, plain, np.ones(1))] == [
            True,
            True,
            False,
            False,
            False,
        ]
        assert other.extended.variable_created_in_scope(others)

    async def test_colocate_vars_with(self) -> None:
        """Variables made in the block are where the given one is (on a mirrored strategy,
        on every device, as all its variables are); its argument is checked as in TF."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            kernel = aioreplica.Variable(np.ones(2), name="kernel")
            with strategy.extended.colocate_vars_with(kernel):
                bias = aioreplica.Variable(0.0, name="bias")
        assert type(bias) is aioreplica.MirroredVariable
        assert bias.devices == kernel.devices == ("cpu:0", "cpu:1")
        assert strategy.extended.variable_created_in_scope(bias)

        async def step() -> Any:
            with strategy.extended.colocate_vars_with(kernel):  # in a replica: its scope
                return replica_id()

        assert (await strategy.run(step)).values == (0, 1)

    async def test_colocate_vars_with_refuses_what_tf_refuses(self) -> None:
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            kernel = aioreplica.Variable(np.ones(2), name="kernel")
        with (
            pytest.raises(RuntimeError, match=r"colocate_vars_with\(\) needs the scope of"),
            strategy.extended.colocate_vars_with(kernel),
        ):
            pass
        other = MirroredStrategy(["cpu:0"])
        with other.scope():
            others = aioreplica.Variable(1.0, name="others")
        plain = aioreplica.Variable(1.0, name="plain")
        with strategy.scope():
            wrong: Any
            for wrong, shown in (
                (others, "MirroredVariable 'others'"),
                (plain, "Variable 'plain'"),
                (np.ones(2), "ndarray"),
            ):
                with (
                    pytest.raises(
                        ValueError,
                        match=f"takes a variable made in the scope of .*, not a {shown}$",
                    ),
                    strategy.extended.colocate_vars_with(wrong),
                ):
                    pass

    async def test_value_container(self) -> None:
        """A variable and a distributed value are their own containers; any other value is
        returned as it is, so it is among its container's local results (TF's invariant)."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            v = aioreplica.Variable(np.ones(2))
        per_replica = PerReplica([np.zeros(1), np.ones(1)])
        component = per_replica.values[1]
        container = strategy.extended.value_container
        assert container(v) is v
        assert container(per_replica) is per_replica
        assert container(component) is component
        assert any(c is component for c in strategy.experimental_local_results(component))
        assert not strategy.extended.experimental_require_static_shapes

        assert strategy.extended.non_slot_devices([v]) == ("cpu:0", "cpu:1")

        async def step() -> bool:
            return container(v) is v and container(component) is component

        # In a replica too, as in TF (where it is a plain lookup).
        assert await strategy.run(step) is True

    async def test_read_var_and_call_for_each_replica(self) -> None:
        """extended.read_var reads in cross-replica context (a sync-on-read variable's
        aggregate), refusing a replica, another strategy's variable and a non-variable;
        call_for_each_replica is run."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            seen = aioreplica.Variable(0, synchronization="on_read", aggregation="sum")
            w = aioreplica.Variable(np.ones(2))
        other = MirroredStrategy(["cpu:0"])
        with other.scope():
            foreign = aioreplica.Variable(1.0, name="foreign")

        async def step(rows: int) -> int:
            await seen.assign_add(rows)
            with pytest.raises(RuntimeError, match=r"read_var\(\) was called inside replica"):
                strategy.extended.read_var(seen)
            ctx = aioreplica.get_replica_context()
            assert ctx is not None
            return ctx.replica_id_in_sync_group

        ids = await strategy.extended.call_for_each_replica(step, (PerReplica([3, 4]),))
        assert strategy.experimental_local_results(ids) == (0, 1)
        assert int(strategy.extended.read_var(seen)) == 7
        np.testing.assert_array_equal(strategy.extended.read_var(w), [1.0, 1.0], strict=True)
        with pytest.raises(ValueError, match="given variable 'foreign', which belongs to"):
            strategy.extended.read_var(foreign)
        with pytest.raises(TypeError, match=r"takes an aioreplica\.Variable, got ndarray"):
            strategy.extended.read_var(np.ones(1))  # type: ignore[arg-type]

    @pytest.mark.parametrize("op", ["sum", "prod"])
    async def test_a_mirrored_variable_cannot_be_summed(self, op: str) -> None:
        """It holds one value on every replica: summing it would count it once per replica
        (TF refuses it too)."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            v = aioreplica.Variable(np.ones(2), name="w")
        with pytest.raises(
            ValueError, match=f"cannot reduce mirrored variable 'w' with {op.upper()}"
        ):
            await strategy.reduce(op, v)
        with pytest.raises(ValueError, match="cannot reduce mirrored variable 'w'"):
            await strategy.extended.reduce_to(op, v, destinations=v)

    @pytest.mark.parametrize("op", ["sum", "prod"])
    async def test_a_mirrored_value_cannot_be_summed(self, op: str) -> None:
        """A Mirrored value holds one value on every replica, as a mirrored variable does:
        SUM and PROD refuse it in every reduction (TF's MirroredExtended._reduce_to too),
        at the root or in a structure, with the place named."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        m = Mirrored([np.float64(3.0), np.float64(3.0)])
        refused = (
            f"^cannot reduce a Mirrored value with {op.upper()}: it holds one value on every "
            f"replica, which {op.upper()} would count once per replica; read it as it is, or "
            "reduce it with MEAN$"
        )
        with pytest.raises(ValueError, match=refused):
            await strategy.reduce(op, m)
        with pytest.raises(ValueError, match=refused):
            await strategy.extended.reduce_to(op, m, destinations="cpu:0")
        with pytest.raises(ValueError, match=refused):
            await strategy.extended.batch_reduce_to(
                op, [(PerReplica([1.0, 2.0]), "cpu:0"), (m, "cpu:0")]
            )
        with pytest.raises(
            ValueError,
            match=rf"^cannot reduce the Mirrored value at \['b'\]\[1\] with {op.upper()}:",
        ):
            await strategy.reduce(op, {"a": PerReplica([1.0, 2.0]), "b": [1.0, m]})

    @pytest.mark.parametrize("op", ["mean", "max", "min"])
    async def test_a_mirrored_value_reduces_to_its_value(self, op: str) -> None:
        """MEAN, MAX and MIN of a Mirrored value are its value."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        m = Mirrored([np.float64(3.0), np.float64(3.0)])
        results = [
            await strategy.reduce(op, m),
            await strategy.extended.reduce_to(op, m, destinations="cpu:0"),
            (await strategy.extended.batch_reduce_to(op, [(m, "cpu:0")]))[0],
            (await strategy.reduce(op, {"m": m}))["m"],
        ]
        assert [float(r) for r in results] == [3.0, 3.0, 3.0, 3.0]
