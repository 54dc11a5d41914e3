"""Cross-replica calls refused on one worker only, before any collective: an update given a
bad ``group`` or another strategy's variable, and calls made in another strategy's scope; and
a worker whose own combine of its replicas raises before its record goes out.
The refusing worker raises its own error, every other worker a ``WorkersDisagree`` naming it;
nothing is written anywhere, and the workers stay in step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

import aioreplica
from aioreplica import MirroredStrategy, PerReplica
from aioreplica.testing import replica_context
from multiworker.mwtools import RANK, WORKERS, allgather, assert_in_step

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from aioreplica import Variable
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

#: The last worker refuses; the others make the call as they should.
REFUSING = WORKERS - 1


async def outcome(call: Callable[[], Awaitable[Any]]) -> str:
    """What ``call`` did on this worker: the type and message of what it raised, or what it
    returned."""
    try:
        returned = await call()
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"returned {returned!r}"


def in_other_scope(
    other: MirroredStrategy, call: Callable[[], Awaitable[Any]]
) -> Callable[[], Awaitable[Any]]:
    """``call`` made in ``other``'s scope on the refusing worker, as it is elsewhere."""

    async def made() -> Any:
        if RANK != REFUSING:
            return await call()
        with other.scope():
            return await call()

    return made


#: Per case: the call on every worker (given the strategy, its variable and another
#: strategy's), and the start of the refusing worker's own error.
CASES: dict[str, tuple[Callable[[Any, Variable, Variable], Callable[[], Any]], str]] = {
    "update with a group that is no bool": (
        lambda s, v, foreign: (
            lambda: s.extended.update(
                v, lambda copy: copy + 1, group="x" if RANK == REFUSING else True
            )
        ),
        "TypeError: extended.update(): group must be True or False, got 'x'",
    ),
    "update in a run() with a group that is no bool": (
        lambda s, v, foreign: (
            lambda: s.run(
                lambda: s.extended.update(
                    v, lambda copy: copy + 1, group="x" if RANK == REFUSING else True
                )
            )
        ),
        "TypeError: extended.update(): group must be True or False, got 'x'",
    ),
    "update of another strategy's variable": (
        lambda s, v, foreign: (
            lambda: s.extended.update(foreign if RANK == REFUSING else v, lambda copy: copy + 1)
        ),
        "ValueError: update() of {strategy} was given variable 'foreign', which belongs to",
    ),
    "update in another scope": (
        lambda s, v, foreign: in_other_scope(
            foreign.distribute_strategy, lambda: s.extended.update(v, lambda copy: copy + 1)
        ),
        "RuntimeError: extended.update() of {strategy} was called in the scope of",
    ),
    "reduce in another scope": (
        lambda s, v, foreign: in_other_scope(
            foreign.distribute_strategy, lambda: s.reduce("sum", PerReplica([np.ones(2)] * 2))
        ),
        "RuntimeError: strategy.reduce() of {strategy} was called in the scope of",
    ),
    "gather in another scope": (
        lambda s, v, foreign: in_other_scope(
            foreign.distribute_strategy, lambda: s.gather(PerReplica([np.ones(2)] * 2))
        ),
        "RuntimeError: strategy.gather() of {strategy} was called in the scope of",
    ),
    "reduce_to in another scope": (
        lambda s, v, foreign: in_other_scope(
            foreign.distribute_strategy,
            lambda: s.extended.reduce_to("sum", PerReplica([np.ones(2)] * 2), "cpu:0"),
        ),
        "RuntimeError: strategy.extended.reduce_to() of {strategy} was called in the scope of",
    ),
    "batch_reduce_to in another scope": (
        lambda s, v, foreign: in_other_scope(
            foreign.distribute_strategy,
            lambda: s.extended.batch_reduce_to("sum", [(PerReplica([np.ones(2)] * 2), "cpu:0")]),
        ),
        "RuntimeError: strategy.extended.batch_reduce_to() of {strategy} was called in the "
        "scope of",
    ),
    "assign in another scope": (
        lambda s, v, foreign: in_other_scope(
            foreign.distribute_strategy, lambda: v.assign(np.full(2, 5.0))
        ),
        "RuntimeError: assign() of variable 'v', created in the scope of {strategy}, was "
        "called in the scope of",
    ),
    "run with options": (
        lambda s, v, foreign: (
            lambda: s.run(lambda: 1, options=object() if RANK == REFUSING else None)
        ),
        "TypeError: run() takes options=None only, got object",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_call_refused_on_one_worker_raises_on_every_worker(
    make_strategy: MakeStrategy, case: str
) -> None:
    """The last worker's call is refused before any collective: it raises its own error,
    every other worker a WorkersDisagree naming it and that error (rather than pairing with
    the refusing worker's next call, which breaks the strategy); the variable keeps its value
    everywhere, and the workers stay in step."""
    strategy = make_strategy(2)
    other = MirroredStrategy(["cpu:4"])
    try:
        with strategy.scope():
            v = aioreplica.Variable(np.ones(2), name="v")
        with other.scope():
            foreign = aioreplica.Variable(np.ones(2), name="foreign")
        v.numpy()  # synced from the chief first, on every worker
        make, refusal = CASES[case]
        message = await outcome(make(strategy, v, foreign))
        if RANK == REFUSING:
            assert message.startswith(refusal.format(strategy=repr(strategy))), message
        else:  # the refusal, as far as it names no worker's own strategy
            assert message.startswith("WorkersDisagree: "), message
            assert f"worker {REFUSING} refused what it was given" in message, message
            assert refusal.partition(" of {strategy}")[0] in message, message
            assert "nothing was done on any worker" in message, message
        assert allgather(v.numpy().tolist()) == [[1.0, 1.0]] * WORKERS
        await assert_in_step(strategy)
    finally:
        other.close()


#: Per place where a worker combines its own replicas' values before its collective: the
#: call, and the start of what the refusing worker raises.
OWN_PARTS: dict[str, tuple[Callable[[Any, Any], Awaitable[Any]], str]] = {
    "strategy.reduce": (
        lambda s, huge: s.reduce("prod", huge, axis=None),
        "overflow encountered in multiply",
    ),
    "strategy.reduce of a structure": (
        lambda s, huge: s.reduce("prod", {"a": huge, "b": huge}, axis=None),
        "overflow encountered in multiply",
    ),
    "strategy.reduce along axis 0": (
        lambda s, huge: s.reduce("sum", huge, axis=0),
        "overflow encountered in reduce",
    ),
    "run()": (
        lambda s, huge: s.run(lambda x: replica_context().all_reduce("prod", x), args=(huge,)),
        "overflow encountered in multiply",
    ),
}


def _value_error(kind: str, flag: int) -> None:
    raise ValueError(f"{kind} in this worker's own values")


@pytest.mark.parametrize("raised", ["FloatingPointError", "ValueError"])
@pytest.mark.parametrize("where", list(OWN_PARTS))
async def test_a_worker_whose_own_combine_raises_refuses_in_step(
    make_strategy: MakeStrategy, where: str, raised: str
) -> None:
    """The last worker's combine of its own replicas raises before its collective (an
    overflow where its NumPy errstate raises, as under warnings turned into errors): it
    raises that error, every other worker at once a WorkersDisagree naming it and the error
    (not a wait for a collective that never comes, nor a failure breaking the strategy), and
    the workers stay in step: once, also for an error that its call refuses in step itself
    (a ValueError, from the errstate's own callback)."""
    strategy = make_strategy(2)
    huge = strategy.experimental_distribute_values_from_function(
        lambda context: np.full((2, 2), 3e38, np.float32)
    )
    call, error = OWN_PARTS[where]
    if raised == "ValueError":
        error = "overflow in this worker's own values"
        errstate = np.errstate(over="call", call=_value_error)
    else:
        errstate = np.errstate(over="raise")
    if RANK != REFUSING:
        errstate = np.errstate(over="ignore")
    with anyio.fail_after(20), errstate:
        try:
            await call(strategy, huge)
        except (FloatingPointError, ValueError) as exc:
            message = f"{type(exc).__name__}: {exc}"
        else:
            message = "returned"
    named = "all_reduce" if where == "run()" else "strategy.reduce"
    if RANK == REFUSING:
        assert message == f"{raised}: {error}", message
    else:
        assert message.startswith("WorkersDisagree: "), message
        assert f"worker {REFUSING} refused what it was given" in message, message
        assert f"{named} refusing its arguments: {raised}: {error}" in message, message
    await assert_in_step(strategy)
