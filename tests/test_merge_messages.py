"""What merge_call says when the replicas pass it arguments of different structures."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

from aioreplica import MirroredStrategy, ReplicaSyncError, Variable, optimizers
from aioreplica.testing import host_devices, replica_context, replica_id

pytestmark = pytest.mark.anyio


def keep(strategy: MirroredStrategy, *args: Any, **kwargs: Any) -> int:
    return 0


class TestMergeArguments:
    async def test_args_of_other_structures_name_the_args_and_the_round(self) -> None:
        """Replicas passing args whose dicts have other keys, in the second merge round: the
        error names merge_call's args, the place in them, the replicas and the round; it does
        not ask the replicas to return anything."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> int:
            ctx = replica_context()
            await ctx.merge_call(keep, args=(1.0,))
            value = {"b" if replica_id() == 0 else "a": 1.0}
            result: int = await ctx.merge_call(keep, args=(0, value))
            return result

        with pytest.raises(ValueError, match="args") as caught:
            await strategy.run(step)
        message = str(caught.value)
        assert message.startswith("merge_call #2 (keep ("), message
        assert message.endswith(
            "): replica 1 passed args that differ from replica 0's at args[1]: keys differ: "
            "'b' only in replica 0, 'a' only in replica 1; every replica must pass merge_call "
            "args of the same structure (the values may differ)"
        ), message
        assert caught.value.__notes__ == ["detected in merge_call #2"]

    async def test_kwargs_of_other_structures_name_the_kwargs(self) -> None:
        """Replicas passing kwargs with other names, or values of other structures: the error
        names merge_call's kwargs and the place in them."""
        strategy = MirroredStrategy(host_devices(3))

        async def step() -> int:
            kwargs: dict[str, Any] = {"x": [1.0, 2.0]} if replica_id() < 2 else {"x": [1.0]}
            result: int = await replica_context().merge_call(keep, kwargs=kwargs)
            return result

        with pytest.raises(ValueError, match="kwargs") as caught:
            await strategy.run(step)
        message = str(caught.value)
        assert message.startswith("merge_call #1 (keep ("), message
        assert "): replica 2 passed kwargs that differ from replica 0's at kwargs['x']: " in message
        assert message.endswith(
            "every replica must pass merge_call kwargs of the same structure (the values may "
            "differ)"
        ), message

    async def test_kwargs_given_by_some_replicas_only(self) -> None:
        """A replica passing kwargs where the others pass none: the error names the keys."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> int:
            kwargs = {"scale": 2.0} if replica_id() == 1 else None
            result: int = await replica_context().merge_call(keep, kwargs=kwargs)
            return result

        with pytest.raises(ValueError, match="kwargs") as caught:
            await strategy.run(step)
        assert "replica 1 passed kwargs that differ from replica 0's at kwargs: " in str(
            caught.value
        )
        assert "'scale' only in replica 1" in str(caught.value)


class TestDifferentCalls:
    async def test_a_collective_against_a_write_names_the_calls(self) -> None:
        """One replica all-reduces while the other writes a variable: the replicas never
        called merge_call themselves, so the note names the calls each made, not merge
        functions, and gives no merge_call advice."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(0.0, aggregation="mean", name="v")

        async def step() -> None:
            if replica_id() == 1:
                await replica_context().all_reduce("sum", 1.0)
            else:
                await v.assign_add(1.0)

        with pytest.raises(ReplicaSyncError) as caught:
            await strategy.run(step)
        notes = caught.value.__notes__
        assert notes[0] == (
            "the replicas made different calls here (replica 0: a write of a variable (assign, "
            "assign_add or assign_sub); replica 1: all_reduce): every replica must make the "
            "same collectives, variable writes, optimizer steps and merge_calls, in the same "
            "order; keep them out of branches that depend on the replica"
        )
        assert float(v) == 0.0

    async def test_a_collective_against_a_merge_call_names_both(self) -> None:
        """A collective against the user's own merge_call: the note names the collective and
        the user's merge function."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            if replica_id() == 0:
                return await replica_context().merge_call(keep)
            return await replica_context().all_gather(np.ones(1), axis=0)

        with pytest.raises(ReplicaSyncError) as caught:
            await strategy.run(step)
        note = caught.value.__notes__[0]
        assert note.startswith(
            "the replicas made different calls here (replica 0: merge_call(keep ("
        ), note
        assert "; replica 1: all_gather): every replica must make" in note, note


class TestMergePointsInMessages:
    """A timeout, or a replica finishing while another waits, names the call the waiting
    replica made (a collective, a write, an optimizer step) and where it made it, not the
    library's merge function."""

    @pytest.mark.parametrize(
        ("call", "words"),
        [
            ("all_reduce", "all_reduce"),
            ("assign_add", "a write of a variable (assign, assign_add or assign_sub)"),
            ("apply_gradients", "an optimizer step (apply_gradients)"),
            ("update", "extended.update of a variable"),
        ],
    )
    async def test_a_timeout_names_the_call_and_where_it_waits(self, call: str, words: str) -> None:
        strategy = MirroredStrategy(host_devices(2), sync_timeout=0.2)
        with strategy.scope():
            v = Variable(np.zeros(2), aggregation="sum")
            optimizer = optimizers.SGD(0.1)
        never = anyio.Event()

        async def step() -> None:
            ctx = replica_context()
            if replica_id() == 1:
                await never.wait()
            grad = np.ones(2)
            if call == "all_reduce":
                await ctx.all_reduce("sum", 1.0)
            elif call == "assign_add":
                await v.assign_add(grad)
            elif call == "apply_gradients":
                await optimizer.apply_gradients([(grad, v)])
            else:
                await strategy.extended.update(v, lambda var, g: var + g, (grad,))

        with anyio.fail_after(5), pytest.raises(ReplicaSyncError) as caught:
            await strategy.run(step)
        message = str(caught.value)
        assert message.startswith(
            f"replica 0 waited 0.2 s in {words} (merge_call #1) at {__file__}:"
        ), message
        assert message.endswith(
            " for replica 1, which did not arrive; a replica is stuck or skips this merge_call "
            "(raise the timeout if it is just slow)"
        ), message
        assert "/aioreplica/" not in message  # no merge function of the library

    async def test_a_replica_finishing_early_names_the_call_the_other_waits_in(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        finished = anyio.Event()

        async def step() -> Any:
            if replica_id() == 1:
                await finished.wait()  # replica 0 waits in its all_reduce by then
                return None
            finished.set()
            return await replica_context().all_reduce("sum", 1.0)

        with anyio.fail_after(5), pytest.raises(ReplicaSyncError) as caught:
            await strategy.run(step)
        message = str(caught.value)
        assert message.startswith(
            "replica 1 finished after 0 merge_call()s while replica 0 waits in all_reduce "
            f"(merge_call #1) at {__file__}:"
        ), message
        assert message.endswith(
            "; every replica must reach the same merge_calls, so move merge_call out of "
            "replica-dependent branches"
        ), message
