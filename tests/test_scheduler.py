"""The scheduler: merge rounds, replica sync errors, failures, cancellation, device following."""

from __future__ import annotations

import functools
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from event_loops import ASYNCIO_ONLY

import aioreplica
from aioreplica import (
    MirroredStrategy,
    PerReplica,
    ReplicaSyncError,
    get_replica_context,
)
from aioreplica._collectives import ReductionEngine
from aioreplica.testing import DeviceLog, RecordingDevice, host_devices, replica_context, replica_id

pytestmark = pytest.mark.anyio


def noop(strategy: MirroredStrategy) -> None:
    return None


class TestMergeCall:
    async def test_merge_fn_runs_once_after_all_arrive(self) -> None:
        """merge_fn runs exactly once per round, only after every replica has arrived."""
        events: list[tuple[str, int]] = []
        strategy = MirroredStrategy(host_devices(3))

        def merge(strategy: MirroredStrategy, ids: PerReplica[int]) -> int:
            events.append(("merge", sum(ids.values)))
            return 0

        async def step() -> None:
            for _ in range(replica_id()):  # replicas reach the merge point at different times
                await anyio.lowlevel.checkpoint()
            events.append(("arrive", replica_id()))
            await replica_context().merge_call(merge, args=(replica_id(),))
            events.append(("resume", replica_id()))

        await strategy.run(step)
        arrivals, merges, resumes = events[:3], events[3:4], events[4:]
        assert sorted(arrivals) == [("arrive", 0), ("arrive", 1), ("arrive", 2)]
        assert merges == [("merge", 3)]
        assert sorted(resumes) == [("resume", 0), ("resume", 1), ("resume", 2)]

    async def test_arguments_regrouped_and_result_selected(self) -> None:
        """Differing args become PerReplica, shared objects stay; each replica gets its slice."""
        shared = object()
        seen: list[Any] = []
        strategy = MirroredStrategy(host_devices(3))

        def merge(
            strategy: MirroredStrategy, value: PerReplica[int], same: object, *, scale: int
        ) -> PerReplica[int]:
            seen.append((value.values, same is shared, scale))
            return PerReplica([v * scale for v in value.values])

        async def step() -> int:
            result: int = await replica_context().merge_call(
                merge, args=(replica_id() + 1, shared), kwargs={"scale": 10}
            )
            return result

        result = await strategy.run(step)
        assert seen == [((1, 2, 3), True, 10)]
        assert isinstance(result, PerReplica)
        assert result.values == (10, 20, 30)

    async def test_nested_structures_round_trip(self) -> None:
        """Nested args regroup leaf by leaf and a nested result is sliced leaf by leaf."""
        strategy = MirroredStrategy(host_devices(2))

        def merge(strategy: MirroredStrategy, tree: dict[str, Any]) -> dict[str, Any]:
            assert tree["name"] == "x"
            assert tree["pair"][0].values == (0, 1)
            return {"sum": sum(tree["pair"][0].values), "mine": tree["pair"][1]}

        async def step() -> dict[str, Any]:
            value = {"pair": (replica_id(), f"r{replica_id()}"), "name": "x"}
            merged: dict[str, Any] = await replica_context().merge_call(merge, args=(value,))
            return merged

        result = await strategy.run(step)
        assert result["sum"] == 1
        assert result["mine"].values == ("r0", "r1")

    async def test_async_merge_fn_is_awaited(self) -> None:
        """A merge_fn that returns an awaitable is awaited once, in cross-replica context."""
        calls: list[bool] = []
        strategy = MirroredStrategy(host_devices(2))

        async def merge(strategy: MirroredStrategy) -> str:
            await anyio.lowlevel.checkpoint()
            calls.append(aioreplica.in_cross_replica_context())
            return "done"

        async def step() -> str:
            result: str = await replica_context().merge_call(merge)
            return result

        assert await strategy.run(step) == "done"
        assert calls == [True]

    async def test_merge_fn_sees_cross_replica_context(self) -> None:
        """Inside merge_fn there is no replica context and the strategy is current."""
        seen: list[object] = []
        strategy = MirroredStrategy(host_devices(2))

        def merge(s: MirroredStrategy) -> None:
            seen.extend(
                [
                    s is strategy,
                    get_replica_context(),
                    aioreplica.in_cross_replica_context(),
                    aioreplica.get_strategy() is strategy,
                ]
            )

        async def step() -> None:
            await replica_context().merge_call(merge)
            seen.append(replica_id())

        await strategy.run(step)
        assert seen[:4] == [True, None, True, True]
        assert sorted(seen[4:]) == [0, 1]  # type: ignore[type-var]

    async def test_several_rounds_keep_their_order(self) -> None:
        """Each round merges the values of that round, in order."""
        strategy = MirroredStrategy(host_devices(4))
        merged: list[tuple[int, ...]] = []

        def merge(strategy: MirroredStrategy, v: PerReplica[int]) -> None:
            merged.append(v.values)

        async def step() -> None:
            for round_number in range(5):
                if (replica_id() + round_number) % 2:
                    await anyio.lowlevel.checkpoint()
                await replica_context().merge_call(merge, args=(10 * round_number + replica_id(),))

        await strategy.run(step)
        assert merged == [tuple(10 * r + i for i in range(4)) for r in range(5)]

    async def test_same_code_in_different_closures_is_fine(self) -> None:
        """Lambdas made per replica share code, and partials with equal arguments agree."""
        strategy = MirroredStrategy(host_devices(3))

        def add(strategy: MirroredStrategy, v: PerReplica[int], offset: int) -> int:
            return sum(v.values) + offset

        async def step() -> tuple[int, int]:
            a: int = await replica_context().merge_call(
                lambda s, v: sum(v.values), args=(replica_id(),)
            )
            b: int = await replica_context().merge_call(
                functools.partial(add, offset=10), args=(replica_id(),)
            )
            return a, b

        assert await strategy.run(step) == (3, 13)

    async def test_partials_with_different_arguments_are_refused(self) -> None:
        """A partial whose bound arguments differ between replicas is not one merge function:
        ReplicaSyncError names the odd replica, and the merge function never runs."""
        strategy = MirroredStrategy(host_devices(3))
        ran: list[int] = []

        def add(strategy: MirroredStrategy, offset: int) -> int:
            ran.append(offset)
            return offset

        async def step() -> int:
            offset = 5 if replica_id() == 1 else 0
            result: int = await replica_context().merge_call(functools.partial(add, offset=offset))
            return result

        with pytest.raises(ReplicaSyncError) as info:
            await strategy.run(step)
        assert (info.value.merge_number, info.value.replicas) == (1, (1,))
        assert "replicas 0 and 2 passed partial(" in str(info.value)
        assert "offset=5" in str(info.value)
        assert ran == []

    async def test_one_replica_merges_immediately(self) -> None:
        """With one replica, merge_fn gets the plain values."""
        strategy = MirroredStrategy(["cpu:0"])

        async def step() -> Any:
            return await replica_context().merge_call(lambda s, v: v * 2, args=(21,))

        assert await strategy.run(step) == 42

    async def test_non_tuple_args_rejected(self) -> None:
        """args that is not a tuple is a TypeError naming the replica and the fix."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            await replica_context().merge_call(noop, args=5)  # type: ignore[arg-type]

        with pytest.raises(TypeError, match=r"replica 0 passed merge_call args=5 .*args=\(5,\)"):
            await strategy.run(step)

    async def test_uncallable_merge_fn_rejected(self) -> None:
        """A merge_fn that is not callable is a TypeError."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            await replica_context().merge_call("not a function")  # type: ignore[arg-type]

        with pytest.raises(TypeError, match="merge_fn must be callable, got str"):
            await strategy.run(step)

    async def test_structure_mismatch_between_replicas(self) -> None:
        """Merge args whose structures differ name both replicas and the key path."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            value: dict[str, Any] = {"a": [1, 2]} if replica_id() == 0 else {"a": [1]}
            await replica_context().merge_call(noop, args=(value,))

        with pytest.raises(ValueError, match=r"replica 1.*replica 0.*\[0\]\['a'\]") as info:
            await strategy.run(step)
        assert any("merge_call #1" in note for note in info.value.__notes__)


class TestMergeResults:
    @pytest.mark.parametrize("count", [2, 4])
    @pytest.mark.parametrize("nested", [False, True], ids=["alone", "in a dict"])
    async def test_a_result_of_another_replica_count_is_refused(
        self, count: int, nested: bool
    ) -> None:
        """A merge_fn result holding a PerReplica of another length than the replicas is a
        ValueError naming merge_fn, on every replica: not cut to the first values, nor an
        IndexError blamed on a replica; no replica goes on past the merge."""
        strategy = MirroredStrategy(host_devices(3))
        went_on: list[int] = []

        def merge_fn(strategy: Any) -> Any:
            wrong = PerReplica(list(range(count)))
            return {"x": wrong} if nested else wrong

        async def step() -> None:
            await replica_context().merge_call(merge_fn)
            went_on.append(replica_id())

        where = r" at \['x'\]" if nested else ""
        with pytest.raises(
            ValueError,
            match=rf"^merge_fn TestMergeResults\..*merge_fn \(.*\) returned a PerReplica of "
            rf"{count} values{where}, but merge_call has 3 replicas here; return one value per "
            r"replica, or a plain value that every replica gets",
        ) as info:
            await strategy.run(step)
        assert info.value.__notes__ == ["detected in merge_call #1, in cross-replica context"]
        assert went_on == []

        async def good() -> Any:
            return await replica_context().merge_call(lambda s: {"x": PerReplica([0, 1, 2])})

        result = await strategy.run(good)  # the strategy goes on
        assert strategy.experimental_local_results(result) == ({"x": 0}, {"x": 1}, {"x": 2})

    async def test_an_async_generator_merge_fn_is_named(self) -> None:
        """A merge_fn with a ``yield`` runs none of its code: a TypeError naming merge_fn, not
        the step function of the replica that got the generator back."""
        strategy = MirroredStrategy(host_devices(2))

        async def merge_fn(strategy: Any) -> Any:
            yield 1

        async def step() -> Any:
            return await replica_context().merge_call(merge_fn)

        with pytest.raises(
            TypeError,
            match=r"^merge_fn TestMergeResults\..*merge_fn \(.*\) is an async generator "
            r"function \(.*: it contains `yield`\), so none of its code ran; a merge_fn "
            r"returns its result: write `return`",
        ) as info:
            await strategy.run(step)
        assert info.value.__notes__[0].startswith("raised by merge_fn TestMergeResults.")


class TestArguments:
    async def test_args_that_are_not_a_tuple_name_the_replica(self) -> None:
        """An array as ``args`` used to fail with "truth value of an array is ambiguous"."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            await replica_context().merge_call(noop, args=np.array([1.0, 2.0]))  # type: ignore[arg-type]

        with pytest.raises(TypeError) as info:
            await strategy.run(step)
        replica = info.value.__notes__[0].split()[3]  # "raised in replica K of 2 ..."
        assert f"replica {replica} passed merge_call args=array([1., 2.]) (ndarray)" in str(
            info.value
        )
        assert "write args=(array([1., 2.]),)" in str(info.value)

    async def test_a_list_of_args_is_taken_as_the_tuple(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            return await replica_context().merge_call(
                lambda s, a, b: sum(a.values) + b,
                args=[replica_id(), 5],  # type: ignore[arg-type]
            )

        assert await strategy.run(step) == 6

    async def test_kwargs_that_are_not_a_mapping_name_the_replica(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            await replica_context().merge_call(noop, kwargs=[("a", 1)])  # type: ignore[arg-type]

        with pytest.raises(TypeError, match="replica 0 passed merge_call kwargs of type list"):
            await strategy.run(step)

    async def test_a_plain_function_may_return_the_merge_call(self) -> None:
        """``def step(): return ctx.merge_call(...)`` is awaited like a returned coroutine
        (it used to fail with "'generator' object has no attribute '__await__'")."""
        strategy = MirroredStrategy(host_devices(3))

        def step() -> Any:
            return replica_context().merge_call(lambda s, v: sum(v.values), args=(replica_id(),))

        assert await strategy.run(step) == 3


class TestForgottenAwait:
    async def test_merge_call_never_awaited(self) -> None:
        """A replica that calls merge_call without awaiting it fails when it finishes."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            replica_context().merge_call(noop)

        with pytest.raises(RuntimeError, match=r"called merge_call\(noop .*\) but never awaited"):
            await strategy.run(step)

    async def test_a_returned_coroutine_never_awaited(self) -> None:
        """``return ctx.all_reduce(x)`` in an async step (the await forgotten) fails the run
        naming the coroutine, instead of handing back coroutine objects that Python later warns
        about (the suite turns that warning into an error: none may come)."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            return replica_context().all_reduce("sum", 1.0)

        with pytest.raises(
            RuntimeError,
            match=r"^replica [01]'s step function returned the coroutine "
            r"ReplicaContext\.all_reduce\(\) without awaiting it; write `return await \.\.\.`",
        ):
            await strategy.run(step)
        assert await strategy.run(lambda: replica_context().all_reduce("sum", 1.0)) == 2.0

    async def test_an_async_generator_step_is_refused(self) -> None:
        """A step function with a ``yield`` (an async generator function) runs none of its
        code: the run fails naming it, instead of handing back generator objects."""
        strategy = MirroredStrategy(host_devices(2))
        ran: list[int] = []

        async def step() -> Any:
            ran.append(replica_id())
            yield await replica_context().all_reduce("sum", 1.0)

        with pytest.raises(
            TypeError,
            match=r"^replica [01]'s step function is an async generator function "
            r"\(TestForgottenAwait\.test_an_async_generator_step_is_refused\.<locals>\.step: "
            r"it contains `yield`\), so none of its code ran; a step function returns its "
            r"result: write `return`",
        ):
            await strategy.run(step)
        assert ran == []
        assert await strategy.run(lambda: replica_context().all_reduce("sum", 1.0)) == 2.0

    async def test_second_merge_call_before_awaiting_the_first(self) -> None:
        """Calling merge_call again before awaiting the first one is refused at once."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            first = replica_context().merge_call(noop)
            replica_context().merge_call(noop)
            await first

        with pytest.raises(RuntimeError, match="called merge_call\\(\\) again before awaiting"):
            await strategy.run(step)

    async def test_trap_awaited_elsewhere_explains_itself(self) -> None:
        """A merge_call awaited in another task fails with the advice in the loop's error."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            pending = replica_context().merge_call(noop)

            async def elsewhere() -> None:
                await pending

            async with anyio.create_task_group() as group:
                group.start_soon(elsewhere)

        with pytest.RaisesGroup(
            pytest.RaisesExc(
                (RuntimeError, TypeError), match="must be awaited by the replica's own coroutine"
            )
        ):
            await strategy.run(step)


class TestReplicaSync:
    async def test_replica_finishing_early_is_named(self) -> None:
        """A replica that finishes while others wait raises ReplicaSyncError, never hangs."""
        strategy = MirroredStrategy(host_devices(3))
        cancelled: list[int] = []

        async def step() -> None:
            try:
                await replica_context().merge_call(noop)
                if replica_id() == 1:
                    return
                await replica_context().merge_call(noop)
            except anyio.get_cancelled_exc_class():
                cancelled.append(replica_id())
                raise

        with pytest.raises(ReplicaSyncError) as info:
            await strategy.run(step)
        err = info.value
        assert (err.merge_number, err.replicas) == (2, (1,))
        assert set(err.waiting) <= {0, 2}
        # Replica 1 ends either while the others wait, or before one of them arrives.
        assert "replica 1 finished after 1 merge_call()s" in str(
            err
        ) or "replica 1 already finished after 1 merge_call()s" in str(err)
        assert "merge_call #2" in str(err)
        assert "move merge_call out of replica-dependent branches" in str(err)
        assert err.waiting
        assert sorted(cancelled) == [0, 2]

    async def test_replica_arriving_after_another_finished(self) -> None:
        """A replica reaching a merge point that a finished replica can never join fails."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            if replica_id() == 1:
                for _ in range(5):
                    await anyio.lowlevel.checkpoint()
                await replica_context().merge_call(noop)

        with pytest.raises(ReplicaSyncError) as info:
            await strategy.run(step)
        assert (info.value.merge_number, info.value.replicas) == (1, (0,))
        message = str(info.value)
        assert message.startswith("replica 1 reached merge_call #1 (noop ("), message
        assert f") at {__file__}:" in message  # where replica 1 awaits it
        assert ", but replica 0 already finished after 0 merge_call()s" in message

    async def test_different_merge_functions_in_one_round(self) -> None:
        """Replicas passing merge functions with different code raise, naming both groups."""
        strategy = MirroredStrategy(host_devices(3))

        def first(strategy: MirroredStrategy) -> None:
            return None

        def second(strategy: MirroredStrategy) -> None:
            return None

        async def step() -> None:
            await replica_context().merge_call(noop)
            await replica_context().merge_call(second if replica_id() == 2 else first)

        with pytest.raises(ReplicaSyncError) as info:
            await strategy.run(step)
        message = str(info.value)
        assert info.value.merge_number == 2
        assert info.value.replicas == (2,)
        assert "replicas 0 and 1 passed" in message
        assert "replica 2 passed" in message
        assert "first" in message
        assert "second" in message

    async def test_sync_timeout_names_late_replicas(self) -> None:
        """With sync_timeout, waiting replicas give up and the late ones are named."""
        strategy = MirroredStrategy(host_devices(3), sync_timeout=0.05)
        never = anyio.Event()
        ended: list[int] = []

        async def step() -> None:
            try:
                if replica_id() == 2:
                    await never.wait()
                await replica_context().merge_call(noop)
            finally:
                ended.append(replica_id())

        with pytest.raises(ReplicaSyncError) as info:
            await strategy.run(step)
        assert (info.value.replicas, info.value.waiting) == ((2,), (0, 1))
        message = str(info.value)
        assert "replicas 0 and 1 waited 0.05 s in merge_call #1 (noop " in message
        assert "for replica 2, which did not arrive" in message
        assert sorted(ended) == [0, 1, 2]  # every replica was cancelled before run() returned

    async def test_sync_timeout_does_not_fire_on_time(self) -> None:
        """Rounds that fill within sync_timeout complete normally."""
        strategy = MirroredStrategy(host_devices(2), sync_timeout=5)

        async def step() -> int:
            for _ in range(3):
                await anyio.sleep(0.001 * replica_id())
                await replica_context().merge_call(noop)
            return replica_id()

        assert (await strategy.run(step)).values == (0, 1)

    async def test_slow_merge_fn_is_not_a_timeout(self) -> None:
        """sync_timeout bounds the wait for replicas to arrive, not merge_fn's own work: a merge
        function that takes longer than it, after every replica arrived, completes normally."""
        strategy = MirroredStrategy(host_devices(3), sync_timeout=0.05)
        merged: list[tuple[int, ...]] = []

        async def slow(strategy: MirroredStrategy, v: PerReplica[int]) -> int:
            await anyio.sleep(0.3)  # six timeouts long
            merged.append(v.values)
            return sum(v.values)

        async def step() -> int:
            total: int = await replica_context().merge_call(slow, args=(replica_id(),))
            return total

        assert await strategy.run(step) == 3
        assert merged == [(0, 1, 2)]

    async def test_slow_collective_is_not_a_timeout(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A collective's ``timeout_seconds`` bounds the arrival of the others, not the
        reduction: one slower than the timeout, after everyone arrived, completes."""
        strategy = MirroredStrategy(host_devices(3))
        reduce = ReductionEngine.all_reduce

        async def slow_reduce(*args: Any, **kwargs: Any) -> Any:
            await anyio.sleep(0.3)  # six timeouts long
            return await reduce(*args, **kwargs)

        monkeypatch.setattr(ReductionEngine, "all_reduce", slow_reduce)
        options = aioreplica.CommunicationOptions(timeout_seconds=0.05)

        async def step() -> Any:
            return await replica_context().all_reduce("sum", float(replica_id()), options=options)

        assert await strategy.run(step) == 3.0

    async def test_fail_after_around_merge_point_leaves_the_round(self) -> None:
        """A replica's own timeout at a merge point cancels only it; the round goes on."""
        strategy = MirroredStrategy(host_devices(2))
        late = anyio.Event()
        events: list[str] = []

        def merge(strategy: MirroredStrategy, v: PerReplica[int]) -> int:
            return sum(v.values)

        async def step() -> int:
            if replica_id() == 0:
                try:
                    with anyio.fail_after(0.02):
                        await replica_context().merge_call(merge, args=(100,))
                except TimeoutError:
                    events.append("replica 0 timed out")
                late.set()
            else:
                await late.wait()
            result: int = await replica_context().merge_call(merge, args=(replica_id(),))
            events.append(f"replica {replica_id()} merged {result}")
            return result

        assert await strategy.run(step) == 1
        assert events[0] == "replica 0 timed out"
        assert sorted(events[1:]) == ["replica 0 merged 1", "replica 1 merged 1"]

    async def test_sync_timeout_outlasts_a_replica_retrying_under_its_own_timeout(self) -> None:
        """The replica timing the round leaves it (its own move_on_after) and comes back, over
        and over: the round keeps its deadline, and a replica that never comes is named."""
        strategy = MirroredStrategy(host_devices(3), sync_timeout=0.2)
        tries: list[int] = []

        async def step() -> None:
            if replica_id() == 2:
                await anyio.sleep_forever()
            while replica_id() == 0:
                with anyio.move_on_after(0.05):
                    await replica_context().merge_call(noop)
                    return
                tries.append(0)
            await replica_context().merge_call(noop)

        with anyio.fail_after(5), pytest.raises(ReplicaSyncError) as info:
            await strategy.run(step)
        assert (info.value.merge_number, info.value.replicas) == (1, (2,))
        assert "waited 0.2 s in merge_call #1" in str(info.value)
        assert 1 <= len(tries) <= 4  # the deadline came from the round, not from each try

    async def test_sync_timeout_fires_for_a_lone_replica_retrying_under_its_own_timeout(
        self,
    ) -> None:
        """The only replica at the round leaves it (its own move_on_after) and comes back, over
        and over: the round keeps its deadline even while nobody waits there, and fails at it
        (it used to restart with every try, and never fired)."""
        strategy = MirroredStrategy(host_devices(2), sync_timeout=0.2)
        tries: list[int] = []

        async def step() -> None:
            if replica_id() == 1:
                await anyio.sleep_forever()
            while True:
                with anyio.move_on_after(0.05):
                    await replica_context().merge_call(noop)
                    return
                tries.append(0)

        with anyio.fail_after(5), pytest.raises(ReplicaSyncError) as info:
            await strategy.run(step)
        assert (info.value.merge_number, info.value.replicas, info.value.waiting) == (1, (1,), (0,))
        assert str(info.value).startswith("replica 0 waited 0.2 s in merge_call #1 (noop ")
        assert 1 <= len(tries) <= 4

    async def test_a_collective_timeout_is_handed_to_a_replica_still_waiting(self) -> None:
        """The replica timing the round leaves it for good: one still parked there takes over
        the watch, and the round fails at its deadline instead of hanging."""
        strategy = MirroredStrategy(host_devices(3))
        options = aioreplica.CommunicationOptions(timeout_seconds=0.2)
        events: list[str] = []

        async def step() -> Any:
            if replica_id() == 0:  # arrives first: it times the round
                with anyio.move_on_after(0.05):
                    await replica_context().all_reduce("sum", 1.0, options=options)
                events.append("replica 0 left the round")
            if replica_id() != 1:
                await anyio.sleep_forever()
            return await replica_context().all_reduce("sum", 1.0, options=options)

        with anyio.fail_after(5), pytest.raises(ReplicaSyncError) as info:
            await strategy.run(step)
        assert events == ["replica 0 left the round"]
        assert (info.value.replicas, info.value.waiting) == ((0, 2), (1,))
        assert str(info.value).startswith(
            f"replica 1 waited 0.2 s in all_reduce (merge_call #1) at {__file__}:"
        )


class TestFailures:
    async def test_an_exception_with_notes_of_its_own_comes_out_as_it_is(self) -> None:
        """An exception whose own code made __notes__ a tuple cannot take a note: run()
        raises that very exception, not add_note's TypeError."""
        strategy = MirroredStrategy(host_devices(2))
        error = ValueError("odd notes")
        error.__notes__ = ("its own",)  # type: ignore[assignment]

        async def step() -> None:
            if replica_id() == 1:
                raise error

        with pytest.raises(ValueError, match=r"^odd notes") as info:
            await strategy.run(step)
        assert info.value is error
        assert getattr(info.value, "__notes__", None) == ("its own",)

    async def test_replica_exception_comes_out_unwrapped(self) -> None:
        """run() raises the failing replica's own exception, noted, after cancelling the rest."""
        strategy = MirroredStrategy(host_devices(3))
        error = ValueError("bad batch")
        cancelled: list[int] = []

        async def step() -> None:
            try:
                await replica_context().merge_call(noop)
                if replica_id() == 1:
                    raise error
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                cancelled.append(replica_id())
                raise

        with pytest.raises(ValueError, match="bad batch") as info:
            await strategy.run(step)
        assert info.value is error
        assert info.value.__notes__ == ["raised in replica 1 of 3 (device cpu:1)"]
        assert sorted(cancelled) == [0, 2]

    async def test_later_failures_are_summarised(self) -> None:
        """Failures of other replicas while the step unwinds become notes on the first."""
        strategy = MirroredStrategy(host_devices(3))

        async def step() -> None:
            if replica_id() == 0:
                await anyio.lowlevel.checkpoint()
                raise KeyError("first")
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                raise RuntimeError(f"cleanup of replica {replica_id()} failed") from None

        with pytest.raises(KeyError) as info:
            await strategy.run(step)
        notes = info.value.__notes__
        assert notes[0] == "raised in replica 0 of 3 (device cpu:0)"
        assert sorted(notes[1:]) == [
            "also raised in replica 1: RuntimeError: cleanup of replica 1 failed",
            "also raised in replica 2: RuntimeError: cleanup of replica 2 failed",
        ]

    async def test_the_same_failure_of_many_replicas_is_one_note(self) -> None:
        """On trio every replica often fails alike before the cancellation reaches it."""
        strategy = MirroredStrategy(host_devices(4))

        async def step() -> None:
            if replica_id() == 0:
                await anyio.lowlevel.checkpoint()
                raise KeyError("first")
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                raise RuntimeError("cleanup failed") from None

        with pytest.raises(KeyError) as info:
            await strategy.run(step)
        assert info.value.__notes__ == [
            "raised in replica 0 of 4 (device cpu:0)",
            "also raised in replicas 1, 2 and 3: RuntimeError: cleanup failed",
        ]

    async def test_a_later_failure_whose_message_raises_does_not_hide_the_first(self) -> None:
        """A later failure whose ``__str__`` raises, or whose message is huge, still becomes a
        short note on the first failure, which run() raises."""
        strategy = MirroredStrategy(host_devices(3))
        first = KeyError("first")

        class Unprintable(Exception):
            def __str__(self) -> str:
                raise RuntimeError("no message")

        async def step() -> None:
            if replica_id() == 0:
                await anyio.lowlevel.checkpoint()
                raise first
            try:
                await anyio.sleep_forever()
            finally:
                if replica_id() == 1:
                    raise Unprintable
                raise ValueError("x" * 5_000_000)

        with pytest.raises(KeyError) as info:
            await strategy.run(step)
        assert info.value is first
        notes = info.value.__notes__
        assert notes[0] == "raised in replica 0 of 3 (device cpu:0)"
        assert "also raised in replica 1: Unprintable: (its message could not be shown)" in notes
        assert len(notes) == 3
        assert sum(map(len, notes)) < 2000

    async def test_stop_iteration_from_merge_fn_names_it(self) -> None:
        """A StopIteration out of merge_fn becomes a RuntimeError naming merge_fn (Python's
        own would say only "coroutine raised StopIteration"), chained to it."""
        strategy = MirroredStrategy(host_devices(2))

        def merge(strategy: MirroredStrategy) -> None:
            next(iter(()))

        async def step() -> None:
            await replica_context().merge_call(merge)

        with anyio.fail_after(5), pytest.raises(RuntimeError) as info:
            await strategy.run(step)
        assert str(info.value).startswith("merge_fn TestFailures.test_stop_iteration_from_")
        assert ") raised StopIteration, which cannot pass out of a coroutine" in str(info.value)
        assert isinstance(info.value.__cause__, StopIteration)
        assert info.value.__notes__[0].startswith("raised by merge_fn ")

    async def test_stop_iteration_from_a_plain_step_function_names_the_replica(self) -> None:
        """A plain (not async) step function's StopIteration names the replica, chained."""
        strategy = MirroredStrategy(host_devices(2))
        empty: list[int] = []

        with (
            anyio.fail_after(5),
            pytest.raises(
                RuntimeError, match=r"^replica [01]'s step function raised StopIteration"
            ) as info,
        ):
            await strategy.run(lambda: next(iter(empty)))
        assert isinstance(info.value.__cause__, StopIteration)

    @pytest.mark.parametrize("where", ["step", "merge_fn"])
    async def test_stop_iteration_from_async_code_names_where_it_came_from(
        self, where: str
    ) -> None:
        """In an async step function or merge function Python itself turns a StopIteration
        into "coroutine raised StopIteration": that too becomes the RuntimeError naming the
        replica or merge_fn, chained to the StopIteration."""
        strategy = MirroredStrategy(host_devices(2))
        empty: list[int] = []

        async def merge(strategy: MirroredStrategy) -> None:
            await anyio.lowlevel.checkpoint()
            next(iter(empty))

        async def step() -> None:
            await anyio.lowlevel.checkpoint()
            if where == "step" and replica_id() == 1:
                next(iter(empty))
            await replica_context().merge_call(merge if where == "merge_fn" else noop)

        with anyio.fail_after(5), pytest.raises(RuntimeError) as info:
            await strategy.run(step)
        message = str(info.value)
        if where == "step":
            assert message.startswith("replica 1's step function raised StopIteration, which ")
        else:
            assert message.startswith("merge_fn TestFailures.test_stop_iteration_from_async_")
            assert ") raised StopIteration, which cannot pass out of a coroutine" in message
        assert isinstance(info.value.__cause__, StopIteration)

    async def test_merge_fn_exception_raised_once(self) -> None:
        """An exception from merge_fn comes out of run() once; every replica is cancelled."""
        strategy = MirroredStrategy(host_devices(3))
        error = ZeroDivisionError("in merge")
        after: list[int] = []
        cancelled: list[int] = []

        def merge(strategy: MirroredStrategy) -> None:
            raise error

        async def step() -> None:
            await replica_context().merge_call(noop)
            try:
                await replica_context().merge_call(merge)
            except anyio.get_cancelled_exc_class():
                cancelled.append(replica_id())
                raise
            after.append(replica_id())

        with pytest.raises(ZeroDivisionError) as info:
            await strategy.run(step)
        assert info.value is error
        assert len(info.value.__notes__) == 1
        assert "raised by merge_fn" in info.value.__notes__[0]
        assert "merge_call #2" in info.value.__notes__[0]
        assert after == []
        assert sorted(cancelled) == [0, 1, 2]

    async def test_caller_cancellation_cancels_every_replica(self) -> None:
        """Cancelling the task awaiting run() cancels every replica; none outlives run()."""
        strategy = MirroredStrategy(host_devices(4))
        ended: list[int] = []
        outcome: list[str] = []

        async def step() -> None:
            try:
                if replica_id() == 3:
                    await anyio.sleep_forever()
                await replica_context().merge_call(noop)
            finally:
                ended.append(replica_id())

        async def caller() -> None:
            try:
                await strategy.run(step)
            except anyio.get_cancelled_exc_class():
                outcome.append(f"cancelled with {sorted(ended)}")
                raise

        async with anyio.create_task_group() as group:
            group.start_soon(caller)
            await anyio.wait_all_tasks_blocked()
            assert strategy.statistics().replicas_waiting == 3
            group.cancel_scope.cancel()
        assert outcome == ["cancelled with [0, 1, 2, 3]"]
        s = strategy.statistics()
        assert (s.runs_active, s.replicas_waiting, s.merge_rounds_completed) == (0, 0, 0)

    async def test_timeout_around_run(self) -> None:
        """A deadline around run() cancels the replicas and ends the run in time."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            await replica_context().merge_call(noop)
            await anyio.sleep_forever()

        with anyio.move_on_after(0.05) as scope:
            await strategy.run(step)
        assert scope.cancelled_caught
        assert strategy.statistics().runs_active == 0


class TestDeviceFollowsReplica:
    @pytest.mark.interleavings(8)
    async def test_device_is_current_at_every_step(self, interleave_seed: int) -> None:
        """Replica code always runs with its own device current, across sleeps and merges,
        whatever the order replicas start and resume in."""
        log = DeviceLog()
        devices = [RecordingDevice(i, log) for i in range(4)]
        strategy = MirroredStrategy(devices, interleave="random", seed=interleave_seed)
        observed: list[tuple[int, str | None]] = []
        in_merge: list[str | None] = []

        def merge(strategy: MirroredStrategy) -> None:
            in_merge.append(log.current)

        async def step() -> None:
            me = replica_id()
            for i in range(3):
                observed.append((me, log.current))
                await anyio.sleep(0.001 * ((me + i) % 3))
                observed.append((me, log.current))
                await replica_context().merge_call(merge)
                observed.append((me, log.current))
                await anyio.lowlevel.checkpoint()

        await strategy.run(step)
        assert observed
        assert [(me, cur) for me, cur in observed if cur != f"rec:{me}"] == []
        assert in_merge == [None, None, None]
        assert log.current is None
        assert log.errors() == []

    async def test_device_is_current_while_unwinding(self) -> None:
        """A cancelled replica's cleanup code also runs with its own device current."""
        log = DeviceLog()
        strategy = MirroredStrategy([RecordingDevice(i, log) for i in range(3)])
        cleanup: list[tuple[int, str | None]] = []

        async def step() -> None:
            me = replica_id()
            try:
                await replica_context().merge_call(noop)
                if me == 0:
                    raise ValueError("stop")
                await anyio.sleep_forever()
            finally:
                cleanup.append((me, log.current))

        with pytest.raises(ValueError, match="stop"):
            await strategy.run(step)
        assert sorted(cleanup) == [(0, "rec:0"), (1, "rec:1"), (2, "rec:2")]
        assert log.current is None


class TestInterleave:
    @ASYNCIO_ONLY
    async def test_ordered_starts_by_id_and_the_completer_carries_on(self) -> None:
        """interleave='ordered': start in id order; the last to arrive resumes first."""
        strategy = MirroredStrategy(host_devices(5))
        events: list[tuple[int, int]] = []

        async def step() -> None:
            for round_number in range(3):
                events.append((round_number, replica_id()))
                await replica_context().merge_call(noop)
            events.append((3, replica_id()))

        await strategy.run(step)
        assert events[:5] == [(0, i) for i in range(5)]
        # Each round, replicas arrive in the order they resumed; the last to arrive completes
        # the round and carries on first, then the others: the order rotates by one.
        order = list(range(5))
        for r in range(1, 4):
            order = order[-1:] + order[:-1]
            assert events[5 * r : 5 * r + 5] == [(r, i) for i in order]

    @ASYNCIO_ONLY
    async def test_ordered_resumes_in_arrival_order_every_time(self) -> None:
        """interleave='ordered' resumes in arrival order (completer first), the same each run."""

        async def trace() -> list[tuple[str, int, int]]:
            strategy = MirroredStrategy(host_devices(5))
            events: list[tuple[str, int, int]] = []

            async def step() -> None:
                for round_number in range(3):
                    for _ in range((replica_id() * 3 + round_number) % 4):  # out of id order
                        await anyio.lowlevel.checkpoint()
                    events.append(("arrive", round_number, replica_id()))
                    await replica_context().merge_call(noop)
                    events.append(("resume", round_number, replica_id()))

            await strategy.run(step)
            return events

        events = await trace()
        for round_number in range(3):
            arrived = [i for kind, r, i in events if (kind, r) == ("arrive", round_number)]
            resumed = [i for kind, r, i in events if (kind, r) == ("resume", round_number)]
            assert resumed == arrived[-1:] + arrived[:-1]  # the completer first
        assert [i for kind, r, i in events if (kind, r) == ("arrive", 0)] != list(range(5))
        assert await trace() == events

    @ASYNCIO_ONLY
    async def test_random_is_a_seeded_shuffle(self) -> None:
        """interleave='random' gives the same order for the same seed, and shuffles it."""

        async def order_for(seed: int) -> list[int]:
            strategy = MirroredStrategy(host_devices(6), interleave="random", seed=seed)
            events: list[int] = []

            async def step() -> None:
                for _ in range(3):
                    events.append(replica_id())
                    await replica_context().merge_call(noop)

            await strategy.run(step)
            return events

        first, again = await order_for(1), await order_for(1)
        assert first == again
        for i in range(3):
            assert sorted(first[6 * i : 6 * i + 6]) == list(range(6))
        orders = {tuple(await order_for(seed)) for seed in range(5)}
        assert len(orders) > 1
        assert tuple(range(6)) * 3 not in orders or len(orders) == 5

    @pytest.mark.parametrize("seed", [3, 11])
    def test_one_order_per_seed_on_every_loop(self, seed: int) -> None:
        """A seed gives one order of starts and resumes, the same on asyncio, uvloop and trio
        (trio runs tasks woken together in an order of its own)."""

        async def order_for() -> tuple[int, ...]:
            strategy = MirroredStrategy(host_devices(5), interleave="random", seed=seed)
            events: list[int] = []

            async def step() -> None:
                events.append(replica_id())
                for _ in range(4):
                    await replica_context().merge_call(noop)
                    events.append(replica_id())

            await strategy.run(step)
            return tuple(events)

        async def orders() -> set[tuple[int, ...]]:
            return {await order_for() for _ in range(10)}

        loops = [
            ("asyncio", {}),
            ("asyncio", {"use_uvloop": True}),
            ("trio", {}),
        ]
        seen = [anyio.run(orders, backend=name, backend_options=options) for name, options in loops]
        assert seen[0] == seen[1] == seen[2]
        assert len(seen[0]) == 1

    @pytest.mark.parametrize("seed", range(6))
    async def test_random_order_with_its_replicas_cancelled_as_the_round_completes(
        self, seed: int
    ) -> None:
        """A merge function cancels the scopes of the replica parked in its round and of the
        last arrival, which runs it: each takes its part and the run goes on, whatever the
        seeded order (trio's gate used to reschedule the running replica: TrioInternalError)."""
        strategy = MirroredStrategy(host_devices(2), interleave="random", seed=seed)
        scopes: list[anyio.CancelScope] = []
        events: list[tuple[int, bool]] = []

        def merge(strategy: MirroredStrategy, value: Any) -> Any:
            for scope in scopes:
                scope.cancel()
            return value

        async def step() -> int:
            with anyio.CancelScope() as scope:
                scopes.append(scope)
                result: int = await replica_context().merge_call(merge, args=(replica_id(),))
            events.append((result, scope.cancelled_caught))
            return result

        for _ in range(2):
            scopes.clear()
            with anyio.fail_after(5):
                assert (await strategy.run(step)).values == (0, 1)
        assert sorted(events) == [(0, False), (0, False), (1, False), (1, False)]

    async def test_drawn_seed_is_reported(self) -> None:
        """Without a seed, random interleave draws one and exposes it for replay."""
        strategy = MirroredStrategy(host_devices(2), interleave="random")
        assert isinstance(strategy.seed, int)
        assert MirroredStrategy(host_devices(2)).seed is None


class TestScale:
    async def test_thousands_of_replicas(self) -> None:
        """2,000 replicas run 10 merge rounds, and every replica gets its own result."""
        strategy = MirroredStrategy(host_devices(2000))

        def merge(strategy: MirroredStrategy, v: PerReplica[int]) -> PerReplica[int]:
            return PerReplica([x + 1 for x in v.values])

        async def step() -> int:
            value = replica_id()
            for _ in range(10):
                value = await replica_context().merge_call(merge, args=(value,))
            return value

        result = await strategy.run(step)
        assert result.values == tuple(range(10, 2010))
        assert strategy.statistics().merge_rounds_completed == 10


class TestStatistics:
    async def test_counts_waiting_replicas_and_rounds(self) -> None:
        """statistics() counts active runs, replicas parked at merge points and rounds done."""
        strategy = MirroredStrategy(host_devices(3))
        go = anyio.Event()
        snapshots: list[aioreplica.SchedulerStatistics] = []

        async def step() -> None:
            if replica_id() == 2:
                await go.wait()
            await replica_context().merge_call(noop)

        async with anyio.create_task_group() as group:
            group.start_soon(strategy.run, step)
            await anyio.wait_all_tasks_blocked()
            snapshots.append(strategy.statistics())
            go.set()
        snapshots.append(strategy.statistics())
        counts = [(s.runs_active, s.replicas_waiting, s.merge_rounds_completed) for s in snapshots]
        assert counts == [(1, 2, 0), (0, 0, 1)]
