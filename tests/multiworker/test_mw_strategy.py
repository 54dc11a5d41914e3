"""The multi-worker strategy's facts, replica ids, run() arguments, merge_call and communicators.

Runs under ``mpiexec -n 2`` (see conftest.py): every rank runs every test, and the tests
compare ranks through ``COMM_WORLD``.
"""

from __future__ import annotations

import gc
import re
import time
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest
from mpi4py import MPI

import aioreplica
from aioreplica import (
    MirroredStrategy,
    MultiWorkerMirroredStrategy,
    PerReplica,
    ReduceOp,
    Variable,
    _cluster,
)
from aioreplica.testing import host_devices, replica_context, replica_id
from multiworker.mwtools import RANK, WORKERS, WORLD, allgather, each_replica, global_ids

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("local", [1, 2])
def test_cluster_facts(make_strategy: MakeStrategy, local: int) -> None:
    """Worker index, worker count and chief come from the communicator; replicas count all."""
    strategy = make_strategy(local)
    assert isinstance(strategy, MirroredStrategy)
    assert isinstance(strategy.cluster, aioreplica.Cluster)
    assert strategy.cluster.worker_index == RANK
    assert strategy.cluster.num_workers == WORKERS
    assert strategy.cluster.is_chief is (RANK == 0)
    assert strategy.num_replicas_in_sync == WORKERS * local
    assert strategy.extended.worker_devices == tuple(host_devices(local))
    assert strategy.extended.parameter_devices == tuple(host_devices(local))
    facts = allgather((strategy.cluster.worker_index, strategy.cluster.is_chief))
    assert facts == [(w, w == 0) for w in range(WORKERS)]
    # TF's names, as its multi-worker programs pick a chief-only write path with them:
    resolver = strategy.cluster_resolver
    assert (resolver.task_type, resolver.task_id) == ("worker", RANK)
    extended = strategy.extended
    roles = allgather(
        (
            extended.experimental_between_graph,
            extended.should_checkpoint,
            extended.should_save_summary,
            extended.experimental_should_init,
        )
    )
    assert roles == [(True, w == 0, w == 0, True) for w in range(WORKERS)]


@pytest.mark.parametrize("local", [1, 2])
async def test_replica_ids_are_global_and_worker_major(
    make_strategy: MakeStrategy, local: int
) -> None:
    """Replica j of worker w is ``w * L + j``; every replica sees the global count."""
    strategy = make_strategy(local)

    async def step() -> tuple[int, int, str]:
        ctx = replica_context()
        return ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync, ctx.device.name

    results = each_replica(strategy, await strategy.run(step))
    assert [r[0] for r in results] == global_ids(local)
    assert [r[1] for r in results] == [WORKERS * local] * local
    assert [r[2] for r in results] == host_devices(local)
    everyone = [r[0] for rank_results in allgather(results) for r in rank_results]
    assert everyone == list(range(WORKERS * local))


@pytest.mark.parametrize("local", [1, 2])
async def test_run_arguments_and_results_are_local(make_strategy: MakeStrategy, local: int) -> None:
    """A local PerReplica (length L) goes in; each replica gets its own; results are local."""
    strategy = make_strategy(local)
    inputs = [np.full(3, 100.0 * RANK + j) for j in range(local)]

    async def step(x: np.ndarray[Any, Any], scale: float) -> np.ndarray[Any, Any]:
        return x * scale + replica_id()

    arg = PerReplica(inputs) if local > 1 else inputs[0]
    result = await strategy.run(step, args=(arg,), kwargs={"scale": 2.0})
    got = strategy.experimental_local_results(result)
    assert len(got) == local
    for j, value in enumerate(got):
        np.testing.assert_array_equal(value, inputs[j] * 2.0 + (RANK * local + j))


async def test_global_length_per_replica_is_refused(
    make_strategy: MakeStrategy,
) -> None:
    """A PerReplica with one value per global replica is a ValueError saying args are local."""
    strategy = make_strategy(2)
    global_arg = PerReplica([np.zeros(1)] * (2 * WORKERS))

    async def step(x: Any) -> Any:
        return x

    with pytest.raises(ValueError, match=r"(?i)local|this worker"):
        await strategy.run(step, args=(global_arg,))
    # The strategy still works (both workers refused before any collective).
    result = await strategy.run(lambda: replica_id())
    assert strategy.experimental_local_results(result) == tuple(global_ids(2))
    with pytest.raises(ValueError, match=rf"{2 * WORKERS} values, but worker {RANK} has 2 local"):
        strategy.experimental_local_results(global_arg)


@pytest.mark.parametrize("collective", [True, False], ids=["all_reduce", "none"])
async def test_arguments_refused_on_one_worker_fail_every_worker(
    make_strategy: MakeStrategy, collective: bool
) -> None:
    """One worker passes a PerReplica of the wrong length: it raises that ValueError, every
    other worker's run() raises a ValueError naming it (at its first collective, or at the end
    of run() when the step makes none) instead of waiting for it, and the strategy goes on in
    step on every worker."""
    strategy = make_strategy(2)
    refusing = WORKERS - 1
    refuses = RANK == WORKERS - 1
    values = PerReplica([np.full(2, float(RANK))] * (3 if refuses else 2))
    ran: list[int] = []

    async def step(x: Any) -> Any:
        ran.append(replica_id())
        if collective:
            return await replica_context().all_reduce("sum", x)
        return x

    started = time.monotonic()
    with pytest.raises(ValueError, match=r"one value per local replica|refusing") as caught:
        await strategy.run(step, args=(values,))
    assert time.monotonic() - started < 5
    message = str(caught.value)
    if refuses:
        assert "one value per local replica" in message, message
        assert ran == []
    else:
        assert f"worker {refusing}: run() refusing its arguments: ValueError" in message, message
        assert sorted(ran) == global_ids(2)

    async def agreed() -> Any:
        return await replica_context().all_reduce("sum", np.ones(2))

    for value in strategy.experimental_local_results(await strategy.run(agreed)):
        np.testing.assert_array_equal(value, np.full(2, 2.0 * WORKERS))


@pytest.mark.parametrize("how", ["run", "run_steps"])
async def test_a_strategy_closed_on_one_worker_refuses_in_step(
    make_strategy: MakeStrategy, how: str
) -> None:
    """run() (or run_steps()) on a strategy closed on one worker raises its RuntimeError there,
    and on every other worker a ValueError naming that worker, at once, instead of waiting for
    it forever; once reopened, the strategy runs in step on every worker again."""
    strategy = make_strategy(2)
    closing = WORKERS - 1
    closes = RANK == WORKERS - 1
    if closes:
        strategy.close()

    async def step(x: Any = 1.0) -> Any:
        return await replica_context().all_reduce("sum", np.ones(2))

    async def call() -> Any:
        if how == "run":
            return await strategy.run(step)
        batches = aiter(strategy.distribute_dataset(aioreplica.batched(np.ones((8, 1)), 4)))
        return await strategy.run_steps(step, batches, 2)

    started = time.monotonic()
    with pytest.raises((RuntimeError, ValueError)) as caught:
        await call()
    assert time.monotonic() - started < 5
    message = str(caught.value)
    if closes:
        assert type(caught.value) is RuntimeError
        assert f"{how}() was called on" in message, message
        assert "after close()" in message, message
    else:
        assert isinstance(caught.value, ValueError)
        refusing = f"worker {closing}: {how}() refusing its arguments: RuntimeError"
        assert refusing in message, message

    async with strategy:  # reopened: every worker runs again, in step
        for value in strategy.experimental_local_results(await strategy.run(step)):
            np.testing.assert_array_equal(value, np.full(2, 2.0 * WORKERS))


async def test_arguments_refused_on_every_worker_raise_each_its_own(
    make_strategy: MakeStrategy,
) -> None:
    """Every worker refusing its arguments, each in its own words: each raises its own error."""
    strategy = make_strategy(1)
    bad = PerReplica([np.zeros(1)] * (2 + RANK))

    with pytest.raises(ValueError, match=f"PerReplica of {2 + RANK} values"):
        await strategy.run(lambda x: x, args=(bad,))
    with pytest.raises(TypeError, match="fn must be callable"):
        await strategy.run(RANK)  # type: ignore[arg-type]
    assert strategy.experimental_local_results(await strategy.run(replica_id)) == (RANK,)


def test_unequal_local_replica_counts_are_refused_on_every_worker() -> None:
    """Workers with 1 and 2 local replicas: every worker gets a ValueError naming the counts."""
    local = 1 if RANK == 0 else 2
    with pytest.raises(ValueError, match="same number of local replicas") as caught:
        MultiWorkerMirroredStrategy(host_devices(local))
    message = str(caught.value)
    assert re.search(r"worker 0\D[^.,;]*\b1\b", message), message
    assert re.search(r"worker 1\D[^.,;]*\b2\b", message), message
    # Every worker refused: the next collective construction still pairs up.
    assert allgather("refused") == ["refused"] * WORKERS


@pytest.mark.parametrize("local", [1, 2])
async def test_merge_fn_runs_once_per_worker_on_local_values(
    make_strategy: MakeStrategy, local: int
) -> None:
    """merge_fn sees this worker's PerReplica; strategy.reduce inside it spans all workers."""
    strategy = make_strategy(local)
    calls: list[int] = []
    rng = np.random.default_rng(7)
    data = rng.normal(size=(WORKERS * local, 4))

    async def merge(s: MirroredStrategy, value: Any) -> Any:
        calls.append(len(s.experimental_local_results(value)))
        total = await s.reduce(ReduceOp.SUM, value)
        mean = await s.reduce("mean", value)
        reduced_to = await s.extended.reduce_to("max", value, host_devices(local)[0])
        return total, mean, reduced_to

    async def step() -> Any:
        ctx = replica_context()
        return await ctx.merge_call(merge, args=(data[ctx.replica_id_in_sync_group],))

    results = each_replica(strategy, await strategy.run(step))
    assert calls == [local]
    for total, mean, reduced_to in results:
        np.testing.assert_allclose(total, data.sum(axis=0), rtol=1e-12)
        np.testing.assert_allclose(mean, data.mean(axis=0), rtol=1e-12)
        np.testing.assert_array_equal(reduced_to, data.max(axis=0))
    assert allgather(len(calls)) == [1] * WORKERS


async def test_run_inside_merge_fn_is_refused(make_strategy: MakeStrategy) -> None:
    """Across workers a merge function cannot run the replicas again (its collectives would
    interleave with the enclosing run's): every worker raises the RuntimeError saying so."""
    strategy = make_strategy(1)

    async def again(s: MirroredStrategy) -> None:
        await s.run(lambda: None)

    with pytest.raises(RuntimeError, match=r"run\(\) was called inside merge_fn; across workers"):
        await strategy.run(lambda: replica_context().merge_call(again))


async def test_merge_fn_sees_its_own_workers_values(
    make_strategy: MakeStrategy,
) -> None:
    """The PerReplica a merge function gets holds the values of this worker's replicas."""
    strategy = make_strategy(2)
    seen: list[list[int]] = []

    def merge(s: MirroredStrategy, ids: Any) -> None:
        seen.append(list(s.experimental_local_results(ids)))

    async def step() -> None:
        await replica_context().merge_call(merge, args=(replica_id(),))

    await strategy.run(step)
    assert allgather(seen) == [[global_ids(2, w)] for w in range(WORKERS)]


def _odd() -> bool:
    """Whether the calling replica is its worker's second (local replica 1)."""
    return replica_id() % 2 == 1


async def _other_shape() -> Any:
    return await replica_context().all_reduce("sum", np.ones(1 + _odd()))


async def _other_gather_shape() -> Any:
    return await replica_context().all_gather(np.ones((1, 1 + _odd())), axis=0)


async def _a_none() -> Any:
    return await replica_context().all_reduce("sum", None if _odd() else 1.0)


async def _other_merge_fn() -> Any:
    ctx = replica_context()
    if _odd():
        return await ctx.all_gather(np.ones(1), axis=0)
    return await ctx.all_reduce("sum", 1.0)


async def _other_structure() -> Any:
    return (1.0, 2.0) if _odd() else (1.0,)


async def _late() -> Any:
    if _odd():
        await anyio.Event().wait()  # never arrives: the other waits out sync_timeout
    return await replica_context().all_reduce("sum", 1.0)


async def _finished_early() -> Any:
    if _odd():
        return None
    return await replica_context().all_reduce("sum", 1.0)


# step, error, what the message says of the odd replica (g1) and of the even one (g0): one of
# the texts after the error (either replica may end first on trio, whose order is random)
NAMED: dict[str, tuple[Callable[[], Awaitable[Any]], type[Exception], tuple[str, ...]]] = {
    "shapes": (
        _other_shape,
        ValueError,
        (
            "replica {g1}'s value at <root> has shape (2,) and dtype float64, replica {g0}'s has "
            "shape (1,)",
        ),
    ),
    "gather shapes": (
        _other_gather_shape,
        ValueError,
        (
            "replica {g1}'s value at <root> has shape (1, 2) and dtype float64, replica {g0}'s has "
            "shape (1, 1)",
        ),
    ),
    "not a number": (_a_none, TypeError, ("replica {g1} passed None (NoneType) to all_reduce",)),
    "merge functions": (
        _other_merge_fn,
        aioreplica.ReplicaSyncError,
        ("replica {g1} passed _merge_all_gather",),
    ),
    "structures": (
        _other_structure,
        ValueError,
        ("replica {g1}'s value differs from replica {g0}'s",),
    ),
    "late": (
        _late,
        aioreplica.ReplicaSyncError,
        ("replica {g0} waited 0.3 s in all_reduce (merge_call #1) at ",),
    ),
    "finished early": (
        _finished_early,
        aioreplica.ReplicaSyncError,
        (
            "replica {g1} finished after 0 merge_call()s while replica {g0} waits in all_reduce "
            "(merge_call #1) at ",
            "replica {g0} reached all_reduce (merge_call #1) at ",
        ),
    ),
}


@pytest.mark.parametrize("case", list(NAMED))
async def test_errors_name_replicas_by_their_ids_in_sync(
    make_strategy: MakeStrategy, case: str
) -> None:
    """An error about a worker's own replicas (each worker's second replica odd) names them by
    their ids in sync, as ``replica_id_in_sync_group`` does (worker 1's are 2 and 3, not 0 and
    1), in the message and in ``ReplicaSyncError.replicas``."""
    strategy = make_strategy(2, sync_timeout=0.3)
    step, error, expected = NAMED[case]
    g0, g1 = global_ids(2)
    with pytest.raises(error) as caught:
        await strategy.run(step)
    message = str(caught.value)
    assert any(text.format(g0=g0, g1=g1) in message for text in expected), message
    if isinstance(caught.value, aioreplica.ReplicaSyncError):
        assert caught.value.workers == ()  # its own replicas' error, not a peer's notice
        assert caught.value.replicas == (g1,)
        assert set(caught.value.waiting) <= {g0, g1}


async def test_distribute_values_from_function_has_global_ids(
    make_strategy: MakeStrategy,
) -> None:
    """ValueContext ids are global; the PerReplica made is local."""
    strategy = make_strategy(2)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync)
    )
    assert strategy.experimental_local_results(value) == tuple(
        (g, 2 * WORKERS) for g in global_ids(2)
    )

    async def step(v: tuple[int, int]) -> bool:
        return v[0] == replica_id()

    assert each_replica(strategy, await strategy.run(step, args=(value,))) == [True, True]


async def test_structures_from_a_value_function_reduce_over_every_worker(
    make_strategy: MakeStrategy,
) -> None:
    """A value_fn returning a structure: reduce and gather take it leaf by leaf, over every
    worker's replicas, in global replica order."""
    strategy = make_strategy(2)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: {"id": np.array([float(ctx.replica_id_in_sync_group)]), "one": (np.ones(1),)}
    )
    total = await strategy.reduce(aioreplica.ReduceOp.SUM, value, axis=None)
    replicas = 2 * WORKERS
    assert total["id"].tolist() == [float(sum(range(replicas)))]
    assert total["one"][0].tolist() == [float(replicas)]
    gathered = await strategy.gather(value, axis=0)
    assert gathered["id"].tolist() == [float(g) for g in range(replicas)]


async def _first_read(strategy: Any) -> Any:
    """A variable made now, read at once: its first read syncs it (a blocking collective)."""
    with strategy.scope():
        fresh = Variable(np.full(3, float(RANK)), name="fresh")
    return fresh.numpy()


#: Cross-worker calls another task may try while a run() is in progress, and their errors.
BESIDE_A_RUN: dict[str, tuple[Callable[[Any, Any], Awaitable[Any]], str]] = {
    "run": (lambda s, c: s.run(lambda: 1), r"run\(\) was called .* while another run\(\)"),
    "reduce": (lambda s, c: s.reduce("sum", PerReplica([np.ones(3)] * 2)), "strategy.reduce"),
    "gather": (lambda s, c: s.gather(PerReplica([np.ones(3)] * 2)), "strategy.gather"),
    "reduce_to": (
        lambda s, c: s.extended.reduce_to("sum", PerReplica([np.ones(3)] * 2), "cpu:0"),
        "extended.reduce_to",
    ),
    "save": (lambda s, c: c.save(f"/nonexistent/beside-{RANK}.npz"), "Checkpoint.save"),
    "first read": (lambda s, c: _first_read(s), "the first read"),
    "assign": (lambda s, c: c.v.assign(np.zeros(3)), r"assign\(\)"),
}
BESIDE = r".* from another task while a run\(\)"


@pytest.mark.parametrize("call", list(BESIDE_A_RUN))
async def test_a_collective_beside_a_run_is_refused(make_strategy: MakeStrategy, call: str) -> None:
    """Another task's cross-worker call while a run() is in progress could pair with one of
    the run()'s collectives on another worker (an all_reduce of the same shape, silently), as
    a second run() could: it raises a RuntimeError before any collective, the run() completes
    on every worker, and the call works once the run() is over."""
    strategy = make_strategy(2)
    with strategy.scope():
        v = Variable(np.full(3, float(RANK)), name="v")
    checkpoint = aioreplica.Checkpoint(v=v)
    make_call, error = BESIDE_A_RUN[call]
    if call != "run":
        error += BESIDE
    started, go_on = anyio.Event(), anyio.Event()
    results: list[Any] = []

    async def step() -> Any:
        started.set()
        await go_on.wait()
        return await replica_context().all_reduce("sum", np.ones(3))

    async def first() -> None:
        results.append(await strategy.run(step))

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        await started.wait()
        with pytest.raises(RuntimeError, match=error):
            await make_call(strategy, checkpoint)
        go_on.set()
    for value in strategy.experimental_local_results(results[0]):
        np.testing.assert_array_equal(value, np.full(3, 2.0 * WORKERS))
    if call != "save":  # (the path is unwritable: only the refusal counted there)
        await make_call(strategy, checkpoint)
    np.testing.assert_array_equal(v.numpy(), np.zeros(3))  # the chief's, synced once


@pytest.mark.parametrize("own_communicator", [False, True], ids=["world", "dup"])
async def test_caller_traffic_on_the_communicator_is_undisturbed(own_communicator: bool) -> None:
    """The caller's messages on the communicator it passed (or COMM_WORLD) arrive untouched,
    between strategy calls and across a run, and the strategy spans the communicator."""
    comm = WORLD.Dup() if own_communicator else WORLD
    try:
        strategy = MultiWorkerMirroredStrategy(
            host_devices(2), communicator=comm if own_communicator else None
        )
        assert comm.bcast(("before", RANK), root=1) == ("before", 1)
        # A receive the caller posts before the run must get the caller's message, not one
        # of the strategy's own.
        pending = comm.irecv(source=(RANK + 1) % WORKERS, tag=77) if RANK == 0 else None

        async def step() -> Any:
            ctx = replica_context()
            total = await ctx.all_reduce("sum", np.full(3, float(ctx.replica_id_in_sync_group)))
            gathered = await ctx.all_gather(np.array([ctx.replica_id_in_sync_group]))
            return total, gathered

        for total, gathered in each_replica(strategy, await strategy.run(step)):
            np.testing.assert_array_equal(total, np.full(3, float(sum(range(2 * WORKERS)))))
            np.testing.assert_array_equal(gathered, np.arange(2 * WORKERS))
        if RANK == 1:
            comm.send(("user message", RANK), dest=0, tag=77)
        if pending is not None:
            assert pending.wait() == ("user message", 1)
        assert comm.allreduce(RANK + 1) == sum(range(1, WORKERS + 1))
        total = await strategy.reduce("sum", PerReplica([np.ones(1)] * 2))
        np.testing.assert_array_equal(total, np.full(1, 2.0 * WORKERS))
        assert comm.bcast("after" if RANK == 0 else None, root=0) == "after"
        strategy.close()
    finally:
        if own_communicator:
            comm.Free()


@pytest.mark.parametrize("interleave", ["ordered", "random"])
async def test_mirrored_keywords_are_accepted(make_strategy: MakeStrategy, interleave: str) -> None:
    """MirroredStrategy's keywords (interleave, seed) work across workers too."""
    seed = 3 if interleave == "random" else None
    strategy = make_strategy(2, interleave=interleave, seed=seed)
    assert (strategy.interleave, strategy.seed) == (interleave, seed)

    async def step() -> Any:
        ctx = replica_context()
        first = await ctx.all_reduce("sum", np.full(2, float(ctx.replica_id_in_sync_group)))
        return await ctx.all_gather(np.asarray(first)[:1] + ctx.replica_id_in_sync_group)

    total = float(sum(range(2 * WORKERS)))
    for got in each_replica(strategy, await strategy.run(step)):
        np.testing.assert_array_equal(got, total + np.arange(2 * WORKERS))


async def test_dropped_strategies_give_their_communicators_back() -> None:
    """Each strategy holds two communicators and MPICH has 2048: made and dropped 1,100 times
    (with a run and a dataset pass each), they are freed, not exhausted."""
    for _ in range(1100):
        strategy = MultiWorkerMirroredStrategy(["cpu:0"])
        batches = [np.arange(4.0)]
        async for batch in strategy.distribute_dataset(batches):
            assert await strategy.run(lambda x: float(x.sum()), (batch,)) == float(batch.sum())
        del strategy
    assert WORLD.allreduce(1) == WORKERS  # MPI is still fine


async def _sum_of_ones() -> Any:
    return await replica_context().all_reduce("sum", 1.0)


async def test_a_failure_notice_never_reaches_a_later_strategy() -> None:
    """MPI gives a freed communicator's context to the next communicator made, and a message
    still on its way to the freed one would be received there: worker 1 drops a strategy,
    then worker 0 fails in it and drops it; the strategy made next on both runs in step
    (worker 1 waiting for worker 0 meanwhile, testing its side channel), never taking the
    notice for its own."""
    broken = MultiWorkerMirroredStrategy(["cpu:0"])
    if RANK != 0:  # dropped: its communicators go back to MPI when the next one is made
        broken.close()
        del broken
        gc.collect()
    between = MultiWorkerMirroredStrategy(["cpu:0"])  # (the other workers free theirs here)
    if RANK == 0:

        async def fail() -> None:
            raise ValueError("worker 0 alone")

        with pytest.raises(ValueError, match="worker 0 alone"):
            await broken.run(fail)
        broken.close()
        del broken
        gc.collect()
    WORLD.Barrier()  # the notice has been sent
    later = MultiWorkerMirroredStrategy(["cpu:0"])
    try:
        if RANK == 0:
            await anyio.sleep(0.3)
        assert await later.run(_sum_of_ones) == float(WORKERS)
    finally:
        later.close()
        between.close()


async def test_a_dropped_strategys_messages_never_reach_the_programs_next_communicators() -> None:
    """Under a timeout each collective tells the peers it was reached, and the last of those
    messages is still unread on one worker when the strategy is dropped. Communicators the
    program makes next (which MPI may give a freed communicator's context) receive none of
    them: an mpi4py ``allreduce`` on one failed on such a message."""
    first = MultiWorkerMirroredStrategy(["cpu:0"], sync_timeout=30)
    for _ in range(3):
        assert await first.run(_sum_of_ones) == float(WORKERS)
    first.close()
    del first
    gc.collect()
    _cluster._free_retired()  # what a strategy made now would do first
    made = [WORLD.Dup() for _ in range(4)]
    try:
        found = [comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG) for comm in made]
        assert allgather(found) == [[False] * 4] * WORKERS
        assert made[-1].allreduce(RANK) == sum(range(WORKERS))
    finally:
        for comm in made:
            comm.Free()


async def test_arrivals_for_a_dropped_strategy_never_hide_a_later_ones_late_worker() -> None:
    """With a timeout, each collective tells the peers it was reached; those still on their
    way when a strategy is dropped (worker 1's, which arrives last) do not count as arrivals
    in the next strategy, whose timeout names the late worker."""
    first = MultiWorkerMirroredStrategy(["cpu:0"], sync_timeout=30)
    for _ in range(3):
        if RANK != 0:
            await anyio.sleep(0.05)
        assert await first.run(_sum_of_ones) == float(WORKERS)
    first.close()
    del first
    gc.collect()
    second = MultiWorkerMirroredStrategy(["cpu:0"], sync_timeout=0.5)
    try:
        if RANK == 0:
            with pytest.raises(aioreplica.ReplicaSyncError) as caught:
                await second.run(_sum_of_ones)
            assert caught.value.workers == tuple(range(1, WORKERS))
            assert "worker 0 waited 0.5 s" in str(caught.value)
        else:
            await anyio.sleep(1.0)
            with pytest.raises(aioreplica.ReplicaSyncError) as caught:
                await second.run(_sum_of_ones)
            assert str(caught.value).startswith("worker 0 gave up waiting for worker")
            assert caught.value.workers == tuple(range(1, WORKERS))
    finally:
        second.close()


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ({"sync_timeout": -1.0}, ValueError),
        ({"communication_options": "fast"}, TypeError),
        ({"communicator": "COMM_WORLD"}, TypeError),
        ({"devices": ["cpu:0", "cpu:0"]}, ValueError),
    ],
    ids=["sync_timeout", "communication_options", "communicator", "devices"],
)
def test_a_worker_refusing_its_arguments_refuses_every_worker(
    bad: dict[str, Any], error: type[Exception]
) -> None:
    """A worker whose arguments are refused raises its own error; every other worker raises a
    ValueError naming it and that error at once, instead of waiting for it in the first
    collective; a valid strategy made next on every worker still pairs up."""
    kwargs = {"devices": host_devices(1), **(bad if RANK == WORKERS - 1 else {})}
    started = time.monotonic()
    with pytest.raises(error if RANK == WORKERS - 1 else ValueError) as caught:
        MultiWorkerMirroredStrategy(**kwargs)
    assert time.monotonic() - started < 5
    if RANK != WORKERS - 1:
        message = str(caught.value)
        assert f"worker {WORKERS - 1} could not make its" in message, message
        assert error.__name__ in message, message
    strategy = MultiWorkerMirroredStrategy(host_devices(1))
    try:
        assert strategy.cluster.num_workers == WORKERS
    finally:
        strategy.close()


class _UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("its __str__ raised")


#: Failures of the last worker whose notice is hard to send: a message far beyond the
#: notice's size in JSON (each emoji an escape of 12 bytes), and one that cannot be shown.
HARD_FAILURES: dict[str, tuple[Callable[[], BaseException], str]] = {
    "long message": (
        lambda: ValueError("\N{GRINNING FACE}" * 2000),
        "ValueError: \N{GRINNING FACE}",
    ),
    "unprintable message": (
        _UnprintableError,
        "_UnprintableError: (its message could not be shown)",
    ),
    "long type name": (lambda: type("E" * 5000, (ValueError,), {})(), "E" * 100),
}


@pytest.mark.parametrize("case", list(HARD_FAILURES))
async def test_a_failure_hard_to_describe_still_names_its_worker(case: str) -> None:
    """The failing worker raises its own exception; every other one a ReplicaSyncError naming
    it (not "worker -1"), with the exception's type and what can be shown of its message,
    within seconds (not a hang)."""
    make_error, shown = HARD_FAILURES[case]
    error = make_error()
    strategy = MultiWorkerMirroredStrategy(["cpu:0"])
    failing = WORKERS - 1

    async def step() -> Any:
        if failing == RANK:
            raise error
        return await replica_context().all_reduce("sum", 1.0)

    try:
        with anyio.fail_after(20):
            if failing == RANK:
                with pytest.raises(type(error)) as own:
                    await strategy.run(step)
                assert own.value is error
            else:
                with pytest.raises(aioreplica.ReplicaSyncError) as caught:
                    await strategy.run(step)
                assert caught.value.workers == (failing,)
                assert f"worker {failing} failed: {shown}" in str(caught.value)
                assert " was raised in replica " in str(caught.value)  # not cut off
    finally:
        WORLD.Barrier()  # both done with the strategy before either frees its communicators
        strategy.close()
