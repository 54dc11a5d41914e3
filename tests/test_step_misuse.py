"""Misused step functions, contexts and strategies are refused clearly: a step or merge function
with a ``yield``, a collective never awaited, copies of a strategy, calls on a closed strategy,
a ``ReplicaContext`` made by hand, output names that are not strings, scopes left out of order.
"""

from __future__ import annotations

import copy
import functools
import pickle
import re
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

import aioreplica
from aioreplica import MirroredStrategy, MultiStepContext, ReplicaContext, Variable
from aioreplica.testing import host_devices, replica_context, replica_id

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


def batches(strategy: MirroredStrategy, steps: int = 2) -> Any:
    """An async iterator of ``steps`` distributed elements of two rows per replica."""
    rows = 2 * strategy.num_replicas_in_sync
    return aiter(strategy.distribute_dataset(aioreplica.batched(np.arange(rows * steps), rows)))


def generator_message(step: str, qualname: str, kind: str = "a step function") -> str:
    """The refusal of a generator function ``qualname`` used as ``step``, as a regex."""
    return re.escape(
        f"{step} is a generator function ({qualname}: it contains `yield`), so none of its code "
        f"ran; {kind} returns its result: write `return`"
    )


@pytest.mark.anyio
class TestGeneratorFunctions:
    async def test_run_refuses_a_generator_step(self) -> None:
        """``run`` and ``call_for_each_replica`` of a step function with a ``yield`` fail
        naming it, instead of returning generator objects; none of its code runs."""
        strategy = MirroredStrategy(host_devices(2))
        ran: list[int] = []

        def step() -> Iterator[int]:
            ran.append(replica_id())
            yield 1

        qualname = "TestGeneratorFunctions.test_run_refuses_a_generator_step.<locals>.step"
        pattern = "^" + r"replica [01]'s step function" + generator_message("", qualname)[1:]
        for call in (strategy.run, strategy.extended.call_for_each_replica):
            with pytest.raises(TypeError, match=pattern):
                await call(step)
        assert ran == []
        assert strategy.experimental_local_results(await strategy.run(replica_id)) == (0, 1)

    async def test_the_step_loops_refuse_a_generator_function(self) -> None:
        """``run_steps``' step_fn and ``experimental_run_steps_on_iterator``'s fn with a
        ``yield`` fail at the first step, naming the loop; none of their code runs."""
        strategy = MirroredStrategy(host_devices(2))
        ran: list[str] = []

        def step_fn(batch: Any) -> Iterator[Any]:
            ran.append("step_fn")
            yield batch

        def fn(context: MultiStepContext, inputs: Any) -> Iterator[Any]:
            ran.append("fn")
            yield inputs

        where = "TestGeneratorFunctions.test_the_step_loops_refuse_a_generator_function.<locals>"
        with pytest.raises(
            TypeError, match="^" + generator_message("run_steps' step_fn", f"{where}.step_fn")
        ):
            await strategy.run_steps(step_fn, batches(strategy), 2)
        loop = "experimental_run_steps_on_iterator()'s fn"
        with pytest.raises(TypeError, match="^" + generator_message(loop, f"{where}.fn")):
            await strategy.extended.experimental_run_steps_on_iterator(fn, batches(strategy), 2)
        assert ran == []

    async def test_a_generator_merge_fn_is_refused(self) -> None:
        """A merge function with a ``yield``, in a run and in the default context, fails
        naming it instead of handing each replica a generator object."""
        strategy = MirroredStrategy(host_devices(2))
        ran: list[str] = []

        def merge_fn(strategy: Any, value: Any) -> Iterator[Any]:
            ran.append("merge_fn")
            yield value

        async def step() -> Any:
            return await replica_context().merge_call(merge_fn, args=(replica_id(),))

        qualname = "TestGeneratorFunctions.test_a_generator_merge_fn_is_refused.<locals>.merge_fn"
        refused = generator_message("", qualname, "a merge_fn")[1:]
        with pytest.raises(TypeError, match=r"^merge_fn \S+\.merge_fn \(.*:\d+\)" + refused):
            await strategy.run(step)
        default = aioreplica.get_replica_context()
        assert default is not None
        with pytest.raises(TypeError, match="^merge_fn" + refused):
            await default.merge_call(merge_fn, args=(1,))
        assert ran == []

    async def test_a_returned_generator_is_a_result(self) -> None:
        """A step function that builds and returns a generator (not one with a ``yield`` of its
        own) returns it as any other result; a ``functools.partial`` of a generator function
        is refused as the function is."""
        strategy = MirroredStrategy(host_devices(2))

        def numbers(count: int) -> Iterator[int]:
            yield from range(count)

        def step() -> Iterator[int]:
            return numbers(replica_id() + 1)

        results = await strategy.run(step)
        assert [list(part) for part in strategy.experimental_local_results(results)] == [
            [0],
            [0, 1],
        ]
        made = await strategy.run(lambda: (n for n in range(2)))
        assert [list(part) for part in strategy.experimental_local_results(made)] == [[0, 1]] * 2
        with pytest.raises(TypeError, match=r"is a generator function \(.*numbers: it contains"):
            await strategy.run(functools.partial(numbers, 2))


#: Each collective of a replica context, called with valid arguments.
COLLECTIVES: dict[str, Callable[[ReplicaContext], Any]] = {
    "all_reduce": lambda ctx: ctx.all_reduce("sum", 1.0),
    "all_gather": lambda ctx: ctx.all_gather(np.ones(1)),
    "broadcast": lambda ctx: ctx.broadcast(np.ones(1)),
    "reduce_scatter": lambda ctx: ctx.reduce_scatter("sum", np.ones(2)),
    "barrier": lambda ctx: ctx.barrier(),
}


@pytest.mark.anyio
class TestCollectiveNeverAwaited:
    @pytest.mark.parametrize("name", list(COLLECTIVES))
    async def test_every_replica_forgets(self, name: str) -> None:
        """A collective called without ``await`` on every replica fails the run naming it,
        instead of being skipped; the strategy stays usable."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> str:
            COLLECTIVES[name](replica_context())
            return "done"

        with pytest.raises(
            RuntimeError,
            match=(
                rf"^replica [01] called ctx\.{name}\(\) but never awaited it, so it took no part "
                rf"in that {name}; write `await ctx\.{name}\(\.\.\.\)`\n"
            ),
        ):
            await strategy.run(step)
        assert await strategy.run(lambda: replica_context().all_reduce("sum", 1.0)) == 2.0

    async def test_one_replica_forgets(self) -> None:
        """Where only replica 0 forgets the ``await``, the error names its never-awaited call,
        not only that replica 1 was left alone at the collective."""
        strategy = MirroredStrategy(host_devices(2), sync_timeout=30)

        async def step() -> Any:
            if replica_id() == 0:
                COLLECTIVES["all_reduce"](replica_context())  # no await
                return 0.0
            return await replica_context().all_reduce("sum", 1.0)

        with pytest.raises(RuntimeError) as caught:
            await strategy.run(step)
        assert str(caught.value) == (
            "replica 0 called ctx.all_reduce() but never awaited it, so it took no part in that "
            "all_reduce; write `await ctx.all_reduce(...)`"
        )

    async def test_collectives_called_first_are_awaited_in_turn(self) -> None:
        """Collectives made first and awaited later, one after another (a list or dict of
        them), each take part in their own collective; a collective is a coroutine, so a
        second await of one is Python's own error."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            ctx = replica_context()
            grads = [np.full(2, ctx.replica_id_in_sync_group + k) for k in range(3)]
            pending = [ctx.all_reduce("sum", g) for g in grads]
            summed = [await p for p in pending]
            named = {"max": ctx.all_reduce("max", float(ctx.replica_id_in_sync_group))}
            biggest = {key: await value for key, value in named.items()}
            with pytest.raises(RuntimeError, match="cannot reuse already awaited coroutine"):
                await pending[0]
            return [s.tolist() for s in summed], biggest

        results = strategy.experimental_local_results(await strategy.run(step))
        assert results == (([[1, 1], [3, 3], [5, 5]], {"max": 1.0}),) * 2

    async def test_a_collective_cut_short_before_its_await_is_never_awaited(self) -> None:
        """A collective called, then left by a cancel scope that ended before its ``await``,
        took no part in its collective: the replica is told so when it ends."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> str:
            with anyio.move_on_after(0):
                pending = replica_context().all_reduce("sum", 1.0)
                await anyio.sleep(1)
                await pending
            return "done"

        with pytest.raises(RuntimeError, match=r"called ctx\.all_reduce\(\) but never awaited"):
            await strategy.run(step)

    async def test_a_collective_awaited_in_a_child_task_names_itself(self) -> None:
        """A collective handed to a child task (a task group's ``start_soon``) is refused there,
        naming that collective and how to bound a wait instead, as ``merge_call`` is."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            async with anyio.create_task_group() as group:
                group.start_soon(replica_context().all_reduce, "sum", 1.0)

        with pytest.raises(BaseExceptionGroup) as caught:  # the task group's
            await strategy.run(step)
        refused, rest = caught.value.split(RuntimeError)
        assert rest is None
        assert refused is not None
        (error,) = refused.exceptions
        message = str(error)
        assert message.startswith("ctx.all_reduce() must be awaited by replica "), message
        assert "`with anyio.fail_after(seconds): await ctx.all_reduce(...)` instead" in message

    async def test_a_stale_context_names_the_collective(self) -> None:
        """A collective on a replica context kept after its run() returned names that
        collective, not merge_call."""
        strategy = MirroredStrategy(host_devices(2))
        kept: list[ReplicaContext] = []

        async def step() -> None:
            kept.append(replica_context())

        await strategy.run(step)
        stale = min(kept, key=lambda ctx: ctx.replica_id_in_sync_group)
        with pytest.raises(
            RuntimeError,
            match=(
                r"^ctx\.all_reduce\(\) was called on replica 0's context after its run\(\) "
                r"returned; a ReplicaContext is valid only inside its own replica$"
            ),
        ):
            await stale.all_reduce("sum", 1.0)


def _copies() -> dict[str, Callable[[Any], Any]]:
    return {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": pickle.dumps}


class TestCopies:
    @pytest.mark.parametrize("how", list(_copies()))
    def test_a_strategy_is_not_copied(self, how: str) -> None:
        """``copy.copy``, ``copy.deepcopy`` and ``pickle`` of a strategy, its ``extended`` and
        the default strategy raise TypeError saying to make a new strategy; the strategy keeps
        its devices, so closing it releases them once."""
        strategy = MirroredStrategy(["cpu:5", "cpu:6"])
        default = aioreplica.get_strategy()
        advice = (
            ": a strategy owns its devices, their worker threads and its scheduler, which a copy "
            "would share (closing either would close them under the other) and a pickle cannot "
            "carry; make a new strategy with the same arguments instead (MirroredStrategy(...)), "
            "or pass this one itself"
        )
        errors = []
        for target in (strategy, strategy.extended, default):
            with pytest.raises(TypeError) as caught:
                _copies()[how](target)
            errors.append(str(caught.value))
        assert errors == [
            f"cannot copy or pickle {strategy!r}{advice}",
            f"cannot copy or pickle {strategy!r}.extended{advice}",
            f"cannot copy or pickle the default strategy, {default!r}{advice}",
        ]
        strategy.close()
        MirroredStrategy(["cpu:5", "cpu:6"]).close()

    @pytest.mark.anyio
    async def test_a_replica_context_is_not_copied(self) -> None:
        """A replica context, in a replica or the default one, is not copied or pickled."""
        strategy = MirroredStrategy(host_devices(2))
        errors: list[str] = []

        def refuse(ctx: Any) -> None:
            for how in _copies().values():
                with pytest.raises(TypeError) as caught:
                    how(ctx)
                errors.append(str(caught.value))

        await strategy.run(lambda: refuse(replica_context()) if replica_id() == 1 else None)
        refuse(aioreplica.get_replica_context())
        advice = (
            ": a replica context is valid only inside its own replica, and it holds its "
            "strategy, which is not copied; call get_replica_context() where the copy was to "
            "be used"
        )
        assert errors == [
            *[f"cannot copy or pickle <ReplicaContext replica 1 of 2 on cpu:1>{advice}"] * 3,
            *[f"cannot copy or pickle <ReplicaContext replica 0 of 1 on cpu:0>{advice}"] * 3,
        ]


@pytest.mark.anyio
class TestClosedStrategy:
    async def test_the_loops_name_themselves(self) -> None:
        """On a closed strategy, ``run_steps``, ``experimental_run_steps_on_iterator`` and
        ``call_for_each_replica`` raise RuntimeError naming the call made, before anything
        is pulled from the iterator."""
        strategy = MirroredStrategy(host_devices(2))
        iterator = batches(strategy)
        strategy.close()
        called: list[str] = []

        async def fn(context: MultiStepContext, inputs: Any) -> None:
            called.append("fn")

        calls: dict[str, Callable[[], Any]] = {
            "run_steps()": lambda: strategy.run_steps(lambda x: x, iterator, 1),
            "experimental_run_steps_on_iterator()": lambda: (
                strategy.extended.experimental_run_steps_on_iterator(fn, iterator, 1)
            ),
            "extended.call_for_each_replica()": lambda: strategy.extended.call_for_each_replica(
                lambda: 1
            ),
        }
        for what, call in calls.items():
            with pytest.raises(RuntimeError) as caught:
                await call()
            assert str(caught.value) == (
                f"{what} was called on {strategy!r} after close(); a closed strategy runs no "
                "replicas: reopen it with `async with strategy:` or make a new strategy"
            )
        assert called == []
        async with strategy:
            assert float(sum((await anext(iterator)).values).sum()) == 6.0  # nothing taken


class TestReplicaContextByHand:
    @pytest.mark.parametrize(
        "arguments",
        [(None, 0), ("engine", 0), ("own", 5), ("own", -1), ("own", 0.0)],
        ids=["no engine", "not an engine", "replica 5 of 2", "replica -1", "float replica"],
    )
    def test_bad_arguments_say_how_to_get_one(self, arguments: tuple[Any, Any]) -> None:
        """``ReplicaContext(...)`` with anything but what ``run()`` gives it raises TypeError
        pointing to ``get_replica_context()``."""
        strategy = MirroredStrategy(host_devices(2))
        engine, replica = arguments
        if engine == "own":
            engine = strategy._engine
        with pytest.raises(
            TypeError,
            match=(
                r"^ReplicaContext\(.*\) was called by hand; strategy\.run\(\) makes the "
                r"ReplicaContext of each of its replicas .*: call "
                r"aioreplica\.get_replica_context\(\) inside a replica instead"
            ),
        ):
            ReplicaContext(strategy, engine, replica, None)


@pytest.mark.anyio
class TestOutputNames:
    async def test_names_must_be_strings(self) -> None:
        """``set_last_step_output``, ``set_non_tensor_output`` and the keys of
        ``initial_loop_values`` refuse a name that is not a str, and record nothing."""
        strategy = MirroredStrategy(host_devices(2))
        context = MultiStepContext()
        errors = []
        with pytest.raises(TypeError) as caught:
            await context.set_last_step_output(3, 1.0)  # type: ignore[arg-type]
        errors.append(str(caught.value))
        with pytest.raises(TypeError) as caught:
            await context.set_non_tensor_output(3, 1.0)  # type: ignore[arg-type]
        errors.append(str(caught.value))

        async def fn(context: MultiStepContext, inputs: Any) -> None:
            errors.append("fn ran")

        with pytest.raises(TypeError) as caught:
            await strategy.extended.experimental_run_steps_on_iterator(
                fn,
                batches(strategy),
                1,
                {1: 2},  # type: ignore[dict-item]
            )
        errors.append(str(caught.value))
        advice = "got int 3; name the output with a string, such as 'loss'"
        assert errors == [
            f"set_last_step_output() takes an output name as a str, {advice}",
            f"set_non_tensor_output() takes an output name as a str, {advice}",
            "experimental_run_steps_on_iterator()'s initial_loop_values takes an output name "
            "as a str, got int 1; name the output with a string, such as 'loss'",
        ]
        assert (context.last_step_outputs, context.non_tensor_outputs) == ({}, {})


class TestScopeOrder:
    def test_an_outer_scope_left_first_stays_until_the_inner_one_is_left(self) -> None:
        """Scopes left out of order (an ``ExitStack``, a generator): the strategy stays
        current while a scope entered later is open, variables made there are still mirrored,
        and once every scope is left no strategy is current."""
        strategy = MirroredStrategy(host_devices(2))
        outer, inner = strategy.scope(), strategy.scope()
        outer.__enter__()
        inner.__enter__()
        outer.__exit__(None, None, None)
        events: list[object] = [aioreplica.get_strategy() is strategy]
        events.append(type(Variable(1.0)).__name__)
        inner.__exit__(None, None, None)
        events.append(aioreplica.has_strategy())
        assert events == [True, "MirroredVariable", False]

    def test_the_default_strategys_scopes_left_out_of_order(self) -> None:
        """The default strategy's scope entered twice and left out of order is closed once
        both are left, with another strategy's scope inside it left in any order too."""
        default = aioreplica.get_strategy()
        strategy = MirroredStrategy(host_devices(2))
        first, second, other = default.scope(), default.scope(), strategy.scope()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        second.__exit__(None, None, None)
        events: list[object] = [Variable(1.0, name="after").__class__.__name__]
        first.__enter__()
        other.__enter__()
        first.__exit__(None, None, None)  # another strategy's scope, entered inside, stays
        events += [aioreplica.get_strategy() is strategy, type(Variable(1.0)).__name__]
        other.__exit__(None, None, None)
        events.append(aioreplica.has_strategy())
        assert events == ["Variable", True, "MirroredVariable", False]
