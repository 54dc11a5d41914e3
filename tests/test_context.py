"""Tests for aioreplica._context and MirroredStrategy.scope(): the three contexts.

Code runs in replica context (inside a replica of ``strategy.run``), in cross-replica context
(inside ``merge_fn`` or ``with strategy.scope():``) or in the default context (anywhere else).
The async classes run on every event loop; the one asyncio-only test has its own class.
"""

from __future__ import annotations

import asyncio
import re
import sys
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import aioreplica
from aioreplica import (
    MirroredStrategy,
    ReplicaContext,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from aioreplica._backends import HostDevice
from aioreplica.testing import replica_context

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

Facts = tuple[ReplicaContext | None, bool, MirroredStrategy, bool]


def facts() -> Facts:
    """Everything the context functions say about where the caller runs."""
    return get_replica_context(), in_cross_replica_context(), get_strategy(), has_strategy()


def default_strategy() -> MirroredStrategy:
    """The default strategy, as seen from the default context."""
    assert get_replica_context() is not None
    assert not has_strategy()
    return get_strategy()


def noop(strategy: MirroredStrategy) -> None:
    return None


def two() -> MirroredStrategy:
    return MirroredStrategy(["cpu:0", "cpu:1"])


class TestGetReplicaContext:
    def test_default_context_outside_any_strategy(self) -> None:
        """Outside any strategy there is a default context: replica 0 of 1 on cpu:0."""
        context = get_replica_context()
        assert context is not None
        assert context.replica_id_in_sync_group == 0
        assert context.num_replicas_in_sync == 1
        assert context.strategy is get_strategy()
        assert context.strategy.num_replicas_in_sync == 1
        assert context.devices == ("cpu:0",)
        assert context.device == HostDevice(0)

    def test_default_context_is_the_same_each_time(self) -> None:
        """The default context is one object, like the default strategy."""
        assert get_replica_context() is get_replica_context()

    def test_none_inside_scope(self) -> None:
        """``with strategy.scope():`` is cross-replica context: no replica context."""
        with two().scope():
            assert get_replica_context() is None

    @pytest.mark.anyio
    async def test_replica_sees_its_own_context(self) -> None:
        """Inside a replica: that replica's id, count, strategy and canonical device."""
        strategy = MirroredStrategy(
            ["/device:CPU:0", "CPU:1", "/job:localhost/replica:0/task:0/device:CPU:2"]
        )
        seen: list[tuple[int, int, bool, tuple[str, ...], HostDevice | None]] = []

        async def step() -> None:
            context = replica_context()
            device = context.device
            seen.append(
                (
                    context.replica_id_in_sync_group,
                    context.num_replicas_in_sync,
                    context.strategy is strategy,
                    context.devices,
                    device if isinstance(device, HostDevice) else None,
                )
            )

        await strategy.run(step)
        assert sorted(seen) == [
            (0, 3, True, ("cpu:0",), HostDevice(0)),
            (1, 3, True, ("cpu:1",), HostDevice(1)),
            (2, 3, True, ("cpu:2",), HostDevice(2)),
        ]

    @pytest.mark.anyio
    async def test_plain_function_replica_sees_its_own_context(self) -> None:
        """A replica that is a plain function sees its context too."""
        strategy = two()

        def step() -> str:
            context = replica_context()
            return f"replica {context.replica_id_in_sync_group} on {context.devices[0]}"

        result = await strategy.run(step)
        assert isinstance(result, aioreplica.PerReplica)
        assert result.values == ("replica 0 on cpu:0", "replica 1 on cpu:1")

    @pytest.mark.anyio
    async def test_replica_context_survives_awaits_and_merges(self) -> None:
        """A replica sees the same context before, between and after awaits and merges."""
        strategy = two()
        events: list[tuple[int, str, bool]] = []

        async def step() -> None:
            mine = replica_context()
            replica_id = mine.replica_id_in_sync_group
            events.append((replica_id, "start", get_replica_context() is mine))
            await anyio.lowlevel.checkpoint()
            events.append((replica_id, "after sleep", get_replica_context() is mine))
            await mine.merge_call(noop)
            events.append((replica_id, "after merge", get_replica_context() is mine))

        await strategy.run(step)
        assert sorted(events) == [
            (0, "after merge", True),
            (0, "after sleep", True),
            (0, "start", True),
            (1, "after merge", True),
            (1, "after sleep", True),
            (1, "start", True),
        ]

    @pytest.mark.anyio
    async def test_none_inside_merge_fn(self) -> None:
        """``merge_fn`` runs in cross-replica context: no replica context."""
        strategy = two()
        seen: list[ReplicaContext | None] = []

        def merge(strategy: MirroredStrategy) -> None:
            seen.append(get_replica_context())

        async def step() -> None:
            await replica_context().merge_call(merge)

        await strategy.run(step)
        assert seen == [None]

    @pytest.mark.anyio
    async def test_none_inside_async_merge_fn_across_awaits(self) -> None:
        """An async ``merge_fn`` stays in cross-replica context across its awaits."""
        strategy = two()
        seen: list[tuple[ReplicaContext | None, bool]] = []

        async def merge(strategy: MirroredStrategy) -> None:
            seen.append((get_replica_context(), in_cross_replica_context()))
            await anyio.lowlevel.checkpoint()
            seen.append((get_replica_context(), in_cross_replica_context()))

        async def step() -> None:
            await replica_context().merge_call(merge)

        await strategy.run(step)
        assert seen == [(None, True), (None, True)]

    @pytest.mark.anyio
    async def test_context_is_default_again_after_run(self) -> None:
        """After ``run()`` returns, the caller is back in the default context."""
        before = facts()
        await two().run(noop, (None,))
        assert facts() == before

    @pytest.mark.anyio
    async def test_repr_names_replica_and_device(self) -> None:
        """repr shows the replica id, the replica count and the device."""
        strategy = MirroredStrategy(["cpu:3", "cpu:5"])

        def step() -> str:
            return repr(replica_context())

        result = await strategy.run(step)
        assert result.values == (
            "<ReplicaContext replica 0 of 2 on cpu:3>",
            "<ReplicaContext replica 1 of 2 on cpu:5>",
        )

    def test_default_repr_names_replica_and_device(self) -> None:
        """The default context's repr shows replica 0 of 1 on cpu:0."""
        assert repr(replica_context()) == "<ReplicaContext replica 0 of 1 on cpu:0>"


class TestInCrossReplicaContext:
    @pytest.mark.anyio
    async def test_exactly_one_of_replica_and_cross_replica_holds(self) -> None:
        """In each context exactly one of "has a replica context" and "cross-replica" holds."""
        strategy = two()
        events: list[tuple[str, bool, bool]] = []

        def record(where: str) -> None:
            events.append((where, get_replica_context() is not None, in_cross_replica_context()))

        def merge(strategy: MirroredStrategy) -> None:
            record("merge_fn")

        async def step() -> None:
            if replica_context().replica_id_in_sync_group == 0:
                record("replica")
            await replica_context().merge_call(merge)

        async def default_merge(strategy: MirroredStrategy) -> None:
            record("default merge_fn")

        record("default")
        with strategy.scope():
            record("scope")
        await strategy.run(step)
        await replica_context().merge_call(default_merge)
        assert events == [
            ("default", True, False),
            ("scope", False, True),
            ("replica", True, False),
            ("merge_fn", False, True),
            ("default merge_fn", False, True),
        ]


class TestGetStrategy:
    def test_default_strategy_outside(self) -> None:
        """Outside any strategy: the default single-replica strategy on cpu:0."""
        strategy = get_strategy()
        assert isinstance(strategy, MirroredStrategy)
        assert strategy.num_replicas_in_sync == 1
        assert strategy.devices == ("cpu:0",)
        assert not has_strategy()
        assert get_strategy() is strategy

    def test_scope_strategy(self) -> None:
        """Inside ``scope()``: that strategy, and ``has_strategy()``."""
        strategy = two()
        with strategy.scope():
            assert (get_strategy() is strategy, has_strategy()) == (True, True)
        assert (get_strategy() is strategy, has_strategy()) == (False, False)

    @pytest.mark.anyio
    async def test_replica_and_merge_fn_strategy(self) -> None:
        """In a replica and in its ``merge_fn``: the running strategy."""
        strategy = two()
        events: list[tuple[str, bool, bool, bool]] = []

        def merge(merge_strategy: MirroredStrategy) -> None:
            events.append(
                ("merge_fn", get_strategy() is strategy, has_strategy(), merge_strategy is strategy)
            )

        async def step() -> None:
            replica_id = replica_context().replica_id_in_sync_group
            events.append(
                (f"replica {replica_id}", get_strategy() is strategy, has_strategy(), True)
            )
            await replica_context().merge_call(merge)

        await strategy.run(step)
        assert sorted(events) == [
            ("merge_fn", True, True, True),
            ("replica 0", True, True, True),
            ("replica 1", True, True, True),
        ]

    def test_default_strategy_is_not_a_user_strategy(self) -> None:
        """A new strategy with the default's devices is still not the default."""
        strategy = MirroredStrategy(["cpu:0"])
        with strategy.scope():
            assert has_strategy()
        assert get_strategy() is not strategy


class TestDefaultMergeCall:
    @pytest.mark.anyio
    async def test_runs_merge_fn_at_once_with_default_strategy(self) -> None:
        """The default context merges at once, passing the default strategy and arguments."""
        strategy = default_strategy()
        calls: list[tuple[MirroredStrategy, tuple[Any, ...], dict[str, Any]]] = []

        def merge(merge_strategy: MirroredStrategy, *args: Any, **kwargs: Any) -> str:
            calls.append((merge_strategy, args, kwargs))
            return "merged"

        result = await replica_context().merge_call(merge, args=(1, [2]), kwargs={"k": 3})
        assert result == "merged"
        assert calls == [(strategy, (1, [2]), {"k": 3})]

    @pytest.mark.anyio
    async def test_awaits_async_merge_fn(self) -> None:
        """An async merge function's result is awaited, not returned as a coroutine."""

        async def merge(strategy: MirroredStrategy, x: int) -> int:
            await anyio.lowlevel.checkpoint()
            return x + 1

        assert await replica_context().merge_call(merge, args=(41,)) == 42

    @pytest.mark.anyio
    async def test_merge_fn_runs_in_cross_replica_context_of_default_strategy(self) -> None:
        """Inside the default merge function: cross-replica context, default strategy."""
        strategy = default_strategy()
        seen: list[Facts] = []

        def merge(merge_strategy: MirroredStrategy) -> None:
            seen.append(facts())

        await replica_context().merge_call(merge)
        assert seen == [(None, True, strategy, False)]

    @pytest.mark.anyio
    async def test_context_restored_after_merge_fn_raises(self) -> None:
        """A merge function's exception comes out of merge_call; the context is restored."""
        before = facts()

        def merge(strategy: MirroredStrategy) -> None:
            raise KeyError("from merge_fn")

        with pytest.raises(KeyError, match="from merge_fn"):
            await replica_context().merge_call(merge)
        assert facts() == before

    @pytest.mark.anyio
    async def test_raises_in_scope(self) -> None:
        """Calling the default context's merge_call inside ``scope()`` is refused."""
        default = replica_context()
        with (
            two().scope(),
            pytest.raises(
                RuntimeError,
                match=(
                    r"^merge_call\(\) was called in cross-replica context \(inside merge_fn or "
                    r"strategy\.scope\(\)\); call it from replica code, or call the merge function "
                    r"directly$"
                ),
            ),
        ):
            await default.merge_call(noop)

    @pytest.mark.anyio
    async def test_raises_inside_its_own_merge_fn(self) -> None:
        """A default merge function cannot nest another default merge_call."""
        default = replica_context()

        async def merge(strategy: MirroredStrategy) -> None:
            await default.merge_call(noop)

        with pytest.raises(RuntimeError, match=r"^merge_call\(\) was called in cross-replica"):
            await default.merge_call(merge)


class TestScope:
    def test_yields_the_strategy(self) -> None:
        """``with strategy.scope() as s`` binds the strategy itself."""
        strategy = two()
        with strategy.scope() as entered:
            assert entered is strategy

    def test_enters_and_leaves_cross_replica_context(self) -> None:
        """Inside: cross-replica context of the strategy; after: the default context again."""
        strategy = two()
        before = facts()
        with strategy.scope():
            inside = facts()
        assert inside == (None, True, strategy, True)
        assert facts() == before

    def test_leaves_on_exception(self) -> None:
        """An exception leaving the block restores the default context."""
        before = facts()
        with pytest.raises(KeyError), two().scope():
            raise KeyError("inside")
        assert facts() == before

    def test_nested_scope_of_same_strategy(self) -> None:
        """Re-entering the current strategy's scope is fine; leaving it keeps the outer one."""
        strategy = two()
        events: list[Facts] = []
        with strategy.scope():
            with strategy.scope() as inner:
                events.append(facts())
                assert inner is strategy
            events.append(facts())
        events.append(facts())
        cross = (None, True, strategy, True)
        assert events == [cross, cross, (replica_context(), False, default_strategy(), False)]

    def test_one_scope_object_entered_again_and_nested(self) -> None:
        """TF's testSameScopeNesting: the object scope() returns may be entered again, and
        inside itself; each exit restores what its entry found."""
        strategy = two()
        scope = strategy.scope()
        default = (replica_context(), False, default_strategy(), False)
        cross = (None, True, strategy, True)
        events: list[Facts] = []
        with scope as first:
            events.append(facts())
            with scope as nested:
                events.append(facts())
            events.append(facts())
        events.append(facts())
        with scope:
            events.append(facts())
        events.append(facts())
        assert first is nested is strategy
        assert events == [cross, cross, cross, default, cross, default]

    @pytest.mark.anyio
    async def test_one_scope_object_in_several_tasks_at_once(self) -> None:
        """Tasks sharing one scope object each enter and leave it on their own: inside, each
        is in the strategy's scope; after, each (and the parent) is back where it was."""
        strategy = two()
        scope = strategy.scope()
        events: list[tuple[str, bool]] = []
        released = anyio.Event()

        async def task(name: str, wait: anyio.Event | None) -> None:
            with scope:
                events.append((f"{name} inside", aioreplica.get_strategy() is strategy))
                if wait is not None:
                    await wait.wait()
                else:
                    released.set()
            events.append((f"{name} after", aioreplica.get_strategy() is strategy))

        async with anyio.create_task_group() as group:
            group.start_soon(task, "first", released)
            await anyio.wait_all_tasks_blocked()
            group.start_soon(task, "second", None)
        assert sorted(events) == [
            ("first after", False),
            ("first inside", True),
            ("second after", False),
            ("second inside", True),
        ]
        assert aioreplica.get_strategy() is not strategy

    @pytest.mark.anyio
    async def test_scope_left_in_another_task_is_refused_clearly(self) -> None:
        """Leaving a scope in a task that did not enter it (one started inside the scope,
        which sees its entry, or one started before it) raises RuntimeError saying so, and
        the scope stays entered where it was, to be left there."""
        strategy = two()
        scope = strategy.scope()
        events: list[object] = []

        async def leave(name: str) -> None:
            try:
                scope.__exit__(None, None, None)
            except RuntimeError as error:
                events.append((name, str(error)))
            events.append((name, facts()[2] is strategy))

        async with anyio.create_task_group() as group:
            started = anyio.Event()

            async def before() -> None:
                await started.wait()
                await leave("started before")

            group.start_soon(before)
            scope.__enter__()
            group.start_soon(leave, "started inside")
            await anyio.wait_all_tasks_blocked()
            started.set()
            await anyio.wait_all_tasks_blocked()
            events.append(("parent", facts()[2] is strategy))
            scope.__exit__(None, None, None)
        events.append(("parent after", facts()[2] is strategy))
        message = (
            f"the scope of {strategy!r} was left in a task or thread that did not enter it; a "
            "scope must be exited in the task that entered it (use `with strategy.scope():` "
            "within one task)"
        )
        assert events == [
            ("started inside", message),
            ("started inside", True),
            ("started before", _no_entry(strategy)),
            ("started before", False),
            ("parent", True),
            ("parent after", False),
        ]

    def test_scope_exited_twice_or_never_entered_says_so(self) -> None:
        """Exiting a scope once more than it was entered, or one never entered, raises
        RuntimeError saying the task holds no entry of it, and changes nothing."""
        strategy = two()
        scope = strategy.scope()
        errors = []
        with scope:
            pass
        for exited in (scope, strategy.scope()):
            with pytest.raises(RuntimeError) as caught:
                exited.__exit__(None, None, None)
            errors.append(str(caught.value))
        assert errors == [_no_entry(strategy)] * 2
        assert not aioreplica.has_strategy()

    @pytest.mark.anyio
    async def test_another_strategys_calls_in_a_scope_are_refused(self) -> None:
        """As TF refuses to mix strategies: run(), reduce, gather and the extended reductions
        of one strategy inside another's scope raise RuntimeError naming both."""
        outer = MirroredStrategy(["cpu:0", "cpu:1"])
        other = MirroredStrategy(["cpu:2", "cpu:3"])
        value = aioreplica.PerReplica([np.ones(1), np.ones(1)])
        with other.scope():
            owned = aioreplica.Variable(np.zeros(1))
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "run()": lambda: other.run(lambda: None),
            "strategy.reduce()": lambda: other.reduce("sum", value),
            "strategy.gather()": lambda: other.gather(value, 0),
            "strategy.extended.batch_reduce_to()": lambda: other.extended.batch_reduce_to(
                "sum", [(value, "cpu:2")]
            ),
            "extended.update()": lambda: other.extended.update(owned, lambda c: c + 1),
        }
        with outer.scope():
            for what, call in calls.items():
                with pytest.raises(
                    RuntimeError,
                    match=(
                        rf"^{re.escape(what)} of {re.escape(repr(other))} was called in "
                        rf"the scope of {re.escape(repr(outer))}; strategies cannot be mixed"
                    ),
                ):
                    await call()
        assert (await other.reduce("sum", value)).tolist() == [2.0]
        assert await other.run(lambda: 7) == 7

    def test_another_scope_can_be_entered_in_the_default_strategys(self) -> None:
        """TF's testScopeMostlyNoOp: the default strategy's scope keeps the default replica
        context, and another strategy's scope can be entered inside it (and left)."""
        other = two()
        default = aioreplica.get_strategy()
        before = facts()
        seen = []
        with default.scope():
            seen.append(facts())
            with other.scope():
                seen.append(facts())
            seen.append(facts())
            with default.scope():  # its own scope again
                seen.append(facts())
        assert seen == [before, (None, True, other, True), before, before]
        assert facts() == before

    def test_a_variable_made_in_another_scope_inside_the_default_strategys_is_refused(
        self,
    ) -> None:
        """TF's testScopeMostlyNoOp: inside the default strategy's scope, a variable made in
        another strategy's scope is refused ("Mixing different tf.distribute.Strategy
        objects"), at any depth of the default scope; one made in the default scope itself is
        a plain variable, and the other strategy's scope makes its variables again once the
        default scope is left."""
        other = two()
        default = aioreplica.get_strategy()
        made = []
        mixing = r"strategies cannot be mixed \(TF: \"Mixing different tf\.distribute\.Strategy"
        with default.scope():
            with other.scope(), pytest.raises(RuntimeError, match=mixing):
                aioreplica.Variable(1.0, name="error")
            with default.scope(), other.scope(), pytest.raises(RuntimeError, match=mixing):
                aioreplica.Variable(1.0, name="also_error")
            made.append(type(aioreplica.Variable(1.0, name="plain")).__name__)
        with other.scope():
            made.append(type(aioreplica.Variable(1.0, name="after")).__name__)
        assert made == ["Variable", "MirroredVariable"]

    @pytest.mark.anyio
    async def test_a_variable_made_in_a_run_inside_the_default_strategys_scope_is_refused(
        self,
    ) -> None:
        """As TF's replica threads and merge_fn keep the default strategy's variable creator,
        a variable made in a replica, or in a merge_fn, of another strategy's run() inside the
        default strategy's scope is refused too."""
        other = two()

        def in_replica() -> None:
            aioreplica.Variable(1.0, name="in_replica")

        async def in_merge_fn() -> None:
            await replica_context().merge_call(
                lambda strategy: aioreplica.Variable(1.0, name="in_merge_fn")
            )

        refused = []
        with aioreplica.get_strategy().scope():
            for step in (in_replica, in_merge_fn):
                with pytest.raises(RuntimeError) as raised:
                    await other.run(step)
                refused.append("strategies cannot be mixed" in str(raised.value))
        assert refused == [True, True]

    def test_the_default_strategy_cannot_be_entered_in_another_scope(self) -> None:
        """As in TF, the default strategy's scope inside another strategy's is refused,
        naming the default strategy as such."""
        other = two()
        default = aioreplica.get_strategy()
        with other.scope():
            with (
                pytest.raises(
                    RuntimeError,
                    match=(
                        rf"^cannot enter the scope of the default strategy, "
                        rf"{re.escape(repr(default))} while {re.escape(repr(other))} is current; "
                        "strategies cannot be mixed"
                    ),
                ),
                default.scope(),
            ):
                pass
            assert facts() == (None, True, other, True)

    @pytest.mark.anyio
    async def test_another_strategys_calls_work_in_the_default_strategys_scope(self) -> None:
        """As in TF, the default strategy's scope changes nothing: another strategy's run(),
        reductions and updates work inside it."""
        other = MirroredStrategy(["cpu:2", "cpu:3"])
        value = aioreplica.PerReplica([np.ones(1), np.full(1, 2.0)])
        with other.scope():
            owned = aioreplica.Variable(np.zeros(1))
        with aioreplica.get_strategy().scope():
            results = [
                await other.run(lambda: 7),
                (await other.reduce("sum", value)).tolist(),
                (await other.gather(value, 0)).tolist(),
                (await other.extended.reduce_to("mean", value, "cpu:2")).tolist(),
                (await other.extended.update(owned, lambda c: c + 1)).tolist(),
            ]
        assert results == [7, [3.0], [1.0, 2.0], [1.5], [1.0]]

    def test_other_strategy_scope_inside_raises_naming_both(self) -> None:
        """Entering another strategy's scope inside one is refused, naming both."""
        outer = MirroredStrategy(["cpu:0", "cpu:1"])
        other = MirroredStrategy(["cpu:2"])
        with outer.scope():
            with (
                pytest.raises(
                    RuntimeError,
                    match=(
                        rf"^cannot enter the scope of {re.escape(repr(other))} while "
                        rf"{re.escape(repr(outer))} is current; strategies cannot be mixed"
                    ),
                ),
                other.scope(),
            ):
                pass
            assert facts() == (None, True, outer, True)

    @pytest.mark.anyio
    async def test_other_strategy_scope_inside_replica_raises_naming_both(self) -> None:
        """A replica cannot enter another strategy's scope; run() re-raises the error."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        other = MirroredStrategy(["cpu:3"])

        async def step() -> None:
            with other.scope():
                pass

        with pytest.raises(
            RuntimeError,
            match=(
                rf"^cannot enter the scope of {re.escape(repr(other))} while "
                rf"{re.escape(repr(strategy))} is current"
            ),
        ) as info:
            await strategy.run(step)
        assert re.fullmatch(
            r"raised in replica [01] of 2 \(device cpu:[01]\)", info.value.__notes__[0]
        )

    @pytest.mark.anyio
    async def test_other_strategy_scope_inside_merge_fn_raises_naming_both(self) -> None:
        """A merge function cannot enter another strategy's scope."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        other = MirroredStrategy(["cpu:4"])

        def merge(merge_strategy: MirroredStrategy) -> None:
            with other.scope():
                pass

        async def step() -> None:
            await replica_context().merge_call(merge)

        with pytest.raises(
            RuntimeError,
            match=(
                rf"^cannot enter the scope of {re.escape(repr(other))} while "
                rf"{re.escape(repr(strategy))} is current"
            ),
        ) as info:
            await strategy.run(step)
        assert info.value.__notes__[0].startswith("raised by merge_fn ")

    @pytest.mark.anyio
    async def test_same_strategy_scope_inside_replica_changes_nothing(self) -> None:
        """Inside its own replica, a strategy's scope leaves the replica context as it is."""
        strategy = two()
        events: list[tuple[int, str, bool]] = []

        async def step() -> None:
            replica_id = replica_context().replica_id_in_sync_group
            before = facts()
            with strategy.scope() as entered:
                events.append((replica_id, "entered is strategy", entered is strategy))
                events.append((replica_id, "inside unchanged", facts() == before))
                await anyio.lowlevel.checkpoint()
                events.append((replica_id, "after await unchanged", facts() == before))
            events.append((replica_id, "after unchanged", facts() == before))
            events.append(
                (replica_id, "still a replica", before[0] is replica_context() and not before[1])
            )

        await strategy.run(step)
        assert sorted(events) == sorted(
            (replica_id, what, True)
            for replica_id in (0, 1)
            for what in (
                "entered is strategy",
                "inside unchanged",
                "after await unchanged",
                "after unchanged",
                "still a replica",
            )
        )

    @pytest.mark.anyio
    async def test_same_strategy_scope_inside_merge_fn_changes_nothing(self) -> None:
        """Inside its own merge function, a strategy's scope keeps cross-replica context."""
        strategy = two()
        events: list[Facts] = []

        def merge(merge_strategy: MirroredStrategy) -> None:
            events.append(facts())
            with strategy.scope():
                events.append(facts())
            events.append(facts())

        async def step() -> None:
            await replica_context().merge_call(merge)

        await strategy.run(step)
        assert events == [(None, True, strategy, True)] * 3


async def _merge_strategy_label(strategy: MirroredStrategy, label: str) -> str:
    await anyio.lowlevel.checkpoint()
    return label if get_strategy() is strategy else "wrong"


class TestConcurrentRuns:
    @pytest.mark.anyio
    async def test_contexts_do_not_leak_between_concurrent_runs(self) -> None:
        """Two strategies' runs interleaved on one loop each see only their own contexts."""
        strategies = {"a": two(), "b": MirroredStrategy(["cpu:2", "cpu:3"])}
        events: list[tuple[str, int, str, str]] = []

        def seen_label() -> str:
            strategy = replica_context().strategy
            assert get_strategy() is strategy
            return next(label for label, s in strategies.items() if s is strategy)

        async def step(label: str) -> None:
            replica_id = replica_context().replica_id_in_sync_group
            for i in range(3):
                events.append((label, replica_id, f"step {i}", seen_label()))
                await anyio.lowlevel.checkpoint()
            merged = await replica_context().merge_call(_merge_strategy_label, args=(label,))
            events.append((label, replica_id, "merge_fn", merged))
            await anyio.lowlevel.checkpoint()
            events.append((label, replica_id, "after merge", seen_label()))

        async with anyio.create_task_group() as group:
            for label, strategy in strategies.items():
                group.start_soon(strategy.run, step, (label,))

        assert sorted(events) == sorted(
            (label, replica_id, where, label)
            for label in ("a", "b")
            for replica_id in (0, 1)
            for where in ("step 0", "step 1", "step 2", "merge_fn", "after merge")
        )
        labels = [event[0] for event in events]
        last_a = len(labels) - 1 - labels[::-1].index("a")
        assert labels.index("b") < last_a, "the two runs did not interleave"


def _mention_merge(strategy: MirroredStrategy) -> str:
    return "merged"


class TestMergeCallMisuse:
    @pytest.mark.anyio
    async def test_context_kept_after_run_raises(self) -> None:
        """A replica context used after its run() returned says so."""
        strategy = two()
        kept: list[ReplicaContext] = []

        async def step() -> None:
            kept.append(replica_context())

        await strategy.run(step)
        kept.sort(key=lambda context: context.replica_id_in_sync_group)
        assert [context.replica_id_in_sync_group for context in kept] == [0, 1]
        with pytest.raises(
            RuntimeError,
            match=(
                r"^merge_call\(\) was called on replica 1's context after its run\(\) "
                r"returned; a ReplicaContext is valid only inside its own replica$"
            ),
        ):
            await kept[1].merge_call(noop)

    @pytest.mark.anyio
    async def test_context_kept_after_run_raises_inside_a_later_run(self) -> None:
        """A stale context stays stale inside a later run of the same strategy."""
        strategy = two()
        kept: list[ReplicaContext] = []

        async def first() -> None:
            kept.append(replica_context())

        async def second() -> None:
            await kept[0].merge_call(noop)

        await strategy.run(first)
        with pytest.raises(RuntimeError, match=r"after its run\(\) returned"):
            await strategy.run(second)

    @pytest.mark.anyio
    async def test_replica_context_used_inside_merge_fn_raises(self) -> None:
        """A merge function cannot call merge_call with a replica's context."""
        strategy = two()
        kept: list[ReplicaContext] = []

        async def merge(merge_strategy: MirroredStrategy) -> None:
            await kept[0].merge_call(noop)

        async def step() -> None:
            kept.append(replica_context())
            await replica_context().merge_call(merge)

        with pytest.raises(
            RuntimeError,
            match=(
                r"^merge_call\(\) was called inside merge_fn \(cross-replica context\) with the "
                r"context of replica [01]; merge functions cannot nest: call what you need "
                r"directly in merge_fn\n"
            ),
        ) as info:
            await strategy.run(step)
        assert info.value.__notes__[0].startswith("raised by merge_fn ")

    @pytest.mark.anyio
    async def test_other_replicas_context_raises(self) -> None:
        """A replica cannot merge with another replica's context."""
        strategy = two()
        contexts: dict[int, ReplicaContext] = {}

        async def step() -> None:
            mine = replica_context()
            contexts[mine.replica_id_in_sync_group] = mine
            await anyio.lowlevel.checkpoint()
            other = contexts[1 - mine.replica_id_in_sync_group]
            await other.merge_call(noop)

        with pytest.raises(
            RuntimeError,
            match=(
                r"^merge_call\(\) was called with replica ([01])'s context outside that "
                r"replica; call get_replica_context\(\) inside the replica instead\n"
            ),
        ):
            await strategy.run(step)

    @pytest.mark.anyio
    async def test_merge_call_from_spawned_task_raises(self) -> None:
        """merge_call awaited by a task the replica spawned is refused, with advice."""
        strategy = two()

        async def child() -> None:
            await replica_context().merge_call(noop)

        async def step() -> None:
            async with anyio.create_task_group() as group:
                group.start_soon(child)

        with pytest.RaisesGroup(
            pytest.RaisesExc(
                RuntimeError,
                match=(
                    r"^merge_call\(\) must be awaited by replica [01]'s own coroutine, not by a "
                    r"task it spawned .*; to bound the wait use "
                    r"`with anyio\.fail_after\(seconds\): await ctx\.merge_call\(\.\.\.\)` "
                    r"instead$"
                ),
            )
        ):
            await strategy.run(step)

    @pytest.mark.anyio
    async def test_fail_after_around_merge_call_works(self) -> None:
        """The advised ``anyio.fail_after`` around a merge point is fine."""
        strategy = two()

        async def step() -> Any:
            with anyio.fail_after(10):
                return await replica_context().merge_call(_mention_merge)

        assert await strategy.run(step) == "merged"


class TestMergeCallMisuseAsyncio:
    @pytest.mark.skipif(
        sys.version_info >= (3, 12),
        reason="asyncio.wait_for awaits its argument in the caller's task from Python 3.12",
    )
    @pytest.mark.asyncio
    async def test_asyncio_wait_for_raises_with_advice(self) -> None:
        """``asyncio.wait_for`` runs merge_call in a new task; the error names it."""
        strategy = two()

        async def step() -> Any:
            return await asyncio.wait_for(replica_context().merge_call(noop), 1)

        with pytest.raises(
            RuntimeError,
            match=r"not by a task it spawned \(.*asyncio\.wait_for.*\).*anyio\.fail_after",
        ) as info:
            await strategy.run(step)
        assert re.fullmatch(
            r"raised in replica [01] of 2 \(device cpu:[01]\)", info.value.__notes__[0]
        )


def _no_entry(strategy: Any) -> str:
    """The error of a scope exited where no entry of it is held."""
    return (
        f"the scope of {strategy!r} was exited, but this task holds no entry of it: it was not "
        "entered, or was exited already, here (or was entered in another task or thread); "
        "exit a scope once per entry, in the task that entered it (`with strategy.scope():` "
        "does); nothing was changed"
    )
