"""Distributed datasets across workers: global batches split in global replica order, the end
of the data agreed every step (partial batches, a worker short of data, a worker with none),
and input pipelines made per worker.

Row i of every table holds the value i, so a slice says which rows it got.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest
from test_dataset import global_batches, table  # the same tables as one process's tests

import aioreplica
from aioreplica import InputContext, batched
from aioreplica.testing import replica_context
from multiworker.mwtools import RANK, WORKERS, WORLD, allgather, each_replica, global_ids

if TYPE_CHECKING:
    from aioreplica import MultiWorkerMirroredStrategy
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]
Table = tuple[Array, Array]


def split(batch: Table, replicas: int) -> list[Table]:
    """What each global replica should get of ``batch``: ``np.array_split`` slices."""
    xs = np.array_split(batch[0], replicas)
    ys = np.array_split(batch[1], replicas)
    return list(zip(xs, ys, strict=True))


def local_slices(strategy: MultiWorkerMirroredStrategy, element: Any) -> list[Table]:
    """This worker's replicas' slices of one element ``(x, y)``."""
    xs = strategy.experimental_local_results(element[0])
    ys = strategy.experimental_local_results(element[1])
    return [(np.asarray(x), np.asarray(y)) for x, y in zip(xs, ys, strict=True)]


def assert_table(got: Table, want: Table) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        assert g.shape == w.shape
        np.testing.assert_array_equal(g, w)


async def rows_seen(strategy: MultiWorkerMirroredStrategy, element: Any) -> int:
    """The global number of rows in ``element``, from a step's all_reduce over all replicas."""

    async def step(x: Array, y: Array) -> Any:
        return await replica_context().all_reduce("sum", np.array(len(y), dtype=np.int64))

    result = await strategy.run(step, args=element)
    return int(strategy.experimental_local_results(result)[0])


@pytest.mark.parametrize("local", [1, 2])
@pytest.mark.parametrize("prefetch", [0, 2])
async def test_global_batches_split_in_global_replica_order(
    make_strategy: MakeStrategy, local: int, prefetch: int
) -> None:
    """Every worker iterates the same global batches; replica g gets slice g of each (the last
    batch partial, with zero-row slices where rows run out), and steps run in between."""
    strategy = make_strategy(local)
    n = WORKERS * local
    batches = global_batches(4 * n + 3, 2 * n + 1)  # uneven splits, a partial last batch
    batches.append(global_batches(1, 1)[0])  # one row: most replicas get none
    steps = 0
    async for element in strategy.distribute_dataset(batches, prefetch=prefetch):
        want = split(batches[steps], n)
        mine = local_slices(strategy, element)
        assert len(mine) == local
        for slice_, g in zip(mine, global_ids(local), strict=True):
            assert_table(slice_, want[g])
        everyone = [s for rank_slices in allgather(mine) for s in rank_slices]
        np.testing.assert_array_equal(np.concatenate([s[1] for s in everyone]), batches[steps][1])
        assert await rows_seen(strategy, element) == len(batches[steps][1])
        steps += 1
    assert steps == len(batches)
    assert allgather(steps) == [len(batches)] * WORKERS


@pytest.mark.parametrize("local", [1, 2])
async def test_batched_source(make_strategy: MakeStrategy, local: int) -> None:
    """aioreplica.batched over a table splits each global batch the same way."""
    strategy = make_strategy(local)
    n = WORKERS * local
    x, y = table(5 * n + 1)
    batches = global_batches(5 * n + 1, 3 * n)
    got = [
        local_slices(strategy, e) async for e in strategy.distribute_dataset(batched((x, y), 3 * n))
    ]
    assert len(got) == len(batches)
    for mine, batch in zip(got, batches, strict=True):
        for slice_, g in zip(mine, global_ids(local), strict=True):
            assert_table(slice_, split(batch, n)[g])


@pytest.mark.parametrize("local", [1, 2])
async def test_a_worker_one_batch_short(make_strategy: MakeStrategy, local: int) -> None:
    """The last worker's dataset ends one batch early: every worker still takes the same
    number of steps; in the last one the short worker's replicas get zero-row slices of the
    right shape and dtype, and the others their slices of their own batch."""
    strategy = make_strategy(local)
    n = WORKERS * local
    batches = global_batches(6 * n, 2 * n)
    short = RANK == WORKERS - 1
    mine_batches = batches[:-1] if short else batches
    steps = 0
    async for element in strategy.distribute_dataset(mine_batches):
        want = split(batches[steps], n)
        slices = local_slices(strategy, element)
        if steps < len(batches) - 1 or not short:
            for slice_, g in zip(slices, global_ids(local), strict=True):
                assert_table(slice_, want[g])
        else:
            for x, y in slices:
                assert (x.shape, x.dtype) == ((0, 3), np.float32)
                assert (y.shape, y.dtype) == ((0,), np.int64)
        # The last step sees only the rows of the workers that had a batch.
        holders = range(n) if steps < len(batches) - 1 else range((WORKERS - 1) * local)
        assert await rows_seen(strategy, element) == sum(len(want[g][1]) for g in holders)
        steps += 1
    assert allgather(steps) == [len(batches)] * WORKERS


@pytest.mark.parametrize("local", [1, 2])
async def test_a_worker_with_no_data(make_strategy: MakeStrategy, local: int) -> None:
    """A worker whose dataset is empty takes every step with zero-row slices shaped and typed
    as the others' data; no one hangs."""
    strategy = make_strategy(local)
    n = WORKERS * local
    batches = global_batches(4 * n, 2 * n)
    empty = RANK == WORKERS - 1
    steps = 0
    async for element in strategy.distribute_dataset([] if empty else batches):
        want = split(batches[steps], n)
        for slice_, g in zip(local_slices(strategy, element), global_ids(local), strict=True):
            if empty:
                x, y = slice_
                assert (x.shape, x.dtype) == ((0, 3), np.float32)
                assert (y.shape, y.dtype) == ((0,), np.int64)
            else:
                assert_table(slice_, want[g])
        holders = range((WORKERS - 1) * local)
        assert await rows_seen(strategy, element) == sum(len(want[g][1]) for g in holders)
        steps += 1
    assert allgather(steps) == [len(batches)] * WORKERS


def _other_on_the_last_worker(batches: list[Table], first_differing: int, how: str) -> Any:
    """``batches``, changed on the last worker from batch ``first_differing`` on (``how``)."""
    if RANK != WORKERS - 1:
        return batches
    changed = batches[first_differing:]
    if how == "values":
        changed = [(x + 1, y) for x, y in changed]
    elif how == "row order":
        changed = [(x[::-1], y[::-1]) for x, y in changed]
    elif how == "structure":
        changed = [{"x": x, "y": y} for x, y in changed]  # type: ignore[misc]
    return batches[:first_differing] + changed


@pytest.mark.parametrize("first_differing", [0, 2])
@pytest.mark.parametrize("how", ["values", "row order", "structure"])
async def test_global_batches_that_differ_between_workers_raise(
    make_strategy: MakeStrategy, how: str, first_differing: int
) -> None:
    """Each worker takes its slices of its own copy of a global batch: copies that differ
    (another shuffle, other data) would train on some rows twice and never on others. The
    workers compare the batches at every step: the first that differs raises the same
    ValueError on every worker, naming it, and the strategy goes on working."""
    strategy = make_strategy(2)
    batches = global_batches(8 * 2 * WORKERS, 2 * 2 * WORKERS)
    steps: list[int] = []

    async def train() -> None:
        dataset = strategy.distribute_dataset(
            _other_on_the_last_worker(batches, first_differing, how)
        )
        async for element in dataset:
            await strategy.run(lambda *x: None, args=element)
            steps.append(len(steps))

    with pytest.raises(ValueError, match="is not the same on every worker") as caught:
        await train()
    assert steps == list(range(first_differing))
    assert f"global batch {first_differing} (from 0)" in str(caught.value)
    assert f"it differs on worker {WORKERS - 1} from worker 0's" in str(caught.value)
    assert len(set(allgather(str(caught.value)))) == 1
    assert each_replica(strategy, await strategy.run(lambda: 1)) == [1, 1]


async def test_an_unseeded_shuffle_on_each_worker_raises(make_strategy: MakeStrategy) -> None:
    """``batched(..., shuffle=True)`` with no seed shuffles otherwise on every worker: refused
    at the first batch. With one seed everywhere the pass runs."""
    strategy = make_strategy(1)
    x = np.arange(64.0).reshape(32, 2)
    seeded = [e async for e in strategy.distribute_dataset(batched(x, 8, shuffle=True, seed=5))]
    assert len(seeded) == 4
    with pytest.raises(ValueError, match="shuffled with the same seed"):
        async for _ in strategy.distribute_dataset(batched(x, 8, shuffle=True)):
            pass


class BadShard(Exception):
    """What the last worker's dataset raises (a corrupt record, say)."""


def _raising_on_the_last_worker(batches: list[Table], at: int) -> Any:
    """``batches``, but the last worker's generator raises ``BadShard`` instead of batch ``at``."""
    for index, batch in enumerate(batches):
        if index == at and RANK == WORKERS - 1:
            raise BadShard(f"record {index} is corrupt")
        yield batch


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("at", [0, 2])
@pytest.mark.parametrize("source", ["distribute_dataset", "distribute_datasets_from_function"])
async def test_a_dataset_that_raises_on_one_worker_ends_the_pass_everywhere(
    make_strategy: MakeStrategy, source: str, at: int, prefetch: int
) -> None:
    """The last worker's dataset raises before batch ``at``: it raises that exception, and
    every other worker a ReplicaSyncError naming it and what it raised, after the same steps,
    instead of waiting for it in the next agreement while it goes on (a hang). The strategy
    goes on working."""
    strategy = make_strategy(2)
    batches = global_batches(16 * 2 * WORKERS, 2 * 2 * WORKERS)  # 8: 4 rounds of 2 replicas
    if source == "distribute_dataset":
        dataset = strategy.distribute_dataset(
            _raising_on_the_last_worker(batches, at), prefetch=prefetch
        )
    else:
        dataset = strategy.distribute_datasets_from_function(
            lambda context: _raising_on_the_last_worker(batches, 2 * at), prefetch=prefetch
        )
    steps: list[int] = []

    async def train() -> None:
        async for element in dataset:
            await strategy.run(lambda *x: None, args=element)
            steps.append(len(steps))

    raising = RANK == WORKERS - 1
    with pytest.raises(BadShard if raising else aioreplica.ReplicaSyncError) as caught:
        await train()
    assert steps == list(range(at))
    if not raising:
        assert caught.value.workers == (WORKERS - 1,)  # type: ignore[attr-defined]
        assert f"the dataset of worker {WORKERS - 1} raised BadShard: record" in str(caught.value)
    assert each_replica(strategy, await strategy.run(lambda: 1)) == [1, 1]


class Shards:
    """A dataset whose iterator cannot start on the last worker (a shard it cannot open)."""

    def __init__(self, batches: list[Table]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        if RANK == WORKERS - 1:
            raise BadShard("cannot open the shard")
        return iter(self.batches)


class AsyncShards(Shards):
    """``Shards`` as an async iterable."""

    def __aiter__(self) -> Any:
        batches = iter(self)  # raises on the last worker

        async def each() -> Any:
            for batch in batches:
                yield batch

        return each()


@pytest.mark.parametrize("kind", [Shards, AsyncShards])
async def test_a_dataset_that_cannot_start_on_one_worker_ends_the_pass_everywhere(
    make_strategy: MakeStrategy, kind: type[Shards]
) -> None:
    """``iter()`` (or ``aiter()``) of the dataset raises on the last worker as the pass starts:
    its ``async for`` raises that, and every other worker's a ReplicaSyncError naming it, with
    no step taken; the strategy goes on working."""
    strategy = make_strategy(2)
    source = kind(global_batches(8 * WORKERS, 4 * WORKERS))
    steps: list[int] = []

    async def train() -> None:
        async for element in strategy.distribute_dataset(source):
            await strategy.run(lambda *x: None, args=element)
            steps.append(len(steps))

    raising = RANK == WORKERS - 1
    with pytest.raises(BadShard if raising else aioreplica.ReplicaSyncError) as caught:
        await train()
    assert steps == []
    if not raising:
        assert f"worker {WORKERS - 1} raised BadShard: cannot open the shard" in str(caught.value)
    assert each_replica(strategy, await strategy.run(lambda: 1)) == [1, 1]


async def test_the_same_batches_of_any_dtype_pass(make_strategy: MakeStrategy) -> None:
    """The comparison takes values only where bytes are values: Python objects (whose bytes
    are addresses, other in every process) and aligned records (whose padding may hold
    anything) compare by structure, shape and dtype, so the same batches pass."""
    strategy = make_strategy(1)
    names = np.array(["a", "bb", "c", "d"] * 2, dtype=object)
    records = np.zeros(8, np.dtype([("a", "i1"), ("b", "f8")], align=True))
    records["b"] = np.arange(8)
    batch = {"names": names, "records": records, "text": names.astype(str), "x": np.arange(8)}
    rows = [len(e["names"]) async for e in strategy.distribute_dataset([batch, batch])]
    assert rows == [8 // WORKERS] * 2


async def test_no_worker_has_data(make_strategy: MakeStrategy) -> None:
    """Empty everywhere: the pass ends at once on every worker."""
    strategy = make_strategy(2)
    got = [e async for e in strategy.distribute_dataset([])]
    assert got == []
    assert allgather(len(got)) == [0] * WORKERS


async def test_iterator_get_next_and_partial_pass(make_strategy: MakeStrategy) -> None:
    """get_next_as_optional agrees on the end; an early break then a new pass still works."""
    strategy = make_strategy(2)
    n = 2 * WORKERS
    batches = global_batches(3 * n, n)
    dataset = strategy.distribute_dataset(batches)
    iterator = aiter(dataset)
    first = await iterator.get_next_as_optional()
    assert first.has_value()
    for slice_, g in zip(local_slices(strategy, first.get_value()), global_ids(2), strict=True):
        assert_table(slice_, split(batches[0], n)[g])
    await iterator.aclose()
    count = 0
    async for element in dataset:
        assert await rows_seen(strategy, element) == n
        count += 1
    assert count == len(batches)


@pytest.mark.parametrize("local", [1, 2])
async def test_distribute_datasets_from_function(make_strategy: MakeStrategy, local: int) -> None:
    """dataset_fn runs once per worker with InputContext(W, w, W * L); replica j of a worker
    gets the j-th per-replica batch of each round of that worker's pipeline."""
    strategy = make_strategy(local)
    n = WORKERS * local
    contexts: list[InputContext] = []

    def dataset_fn(context: InputContext) -> Any:
        contexts.append(context)
        size = context.get_per_replica_batch_size(2 * n)
        rows = np.arange(4 * local * size) + 1000 * context.input_pipeline_id
        return batched(rows, size)

    got = [
        [np.asarray(v) for v in strategy.experimental_local_results(e)]
        async for e in strategy.distribute_datasets_from_function(dataset_fn)
    ]
    assert len(contexts) == 1
    context = contexts[0]
    assert context.num_input_pipelines == WORKERS
    assert context.input_pipeline_id == RANK
    assert context.num_replicas_in_sync == n
    assert len(got) == 4
    flat = np.concatenate([part for round_ in got for part in round_])
    np.testing.assert_array_equal(flat, np.arange(4 * local * 2) + 1000 * RANK)


@pytest.mark.parametrize("local", [1, 2])
async def test_from_function_elements_without_a_batch_dimension(
    make_strategy: MakeStrategy, local: int
) -> None:
    """Elements without a batch dimension go round-robin to each worker's replicas; when the
    last worker's pipeline runs out first, its replicas cannot get empty batches of them:
    every worker raises the same TypeError after the same rounds, and the strategy goes on."""
    strategy = make_strategy(local)
    rounds = 3 if RANK == WORKERS - 1 else 4

    def dataset_fn(context: InputContext) -> Any:
        return [(100 * context.input_pipeline_id + i, float(i)) for i in range(rounds * local)]

    got: list[list[tuple[int, float]]] = []

    async def take() -> None:
        async for element in strategy.distribute_datasets_from_function(dataset_fn):
            got.append([(int(a), float(b)) for a, b in each_replica(strategy, element)])  # noqa: PERF401

    with pytest.raises(
        TypeError,
        match=rf"the dataset ran out on worker {WORKERS - 1} before the others, and its elements "
        r"have no batch dimension",
    ):
        await take()
    assert got == [
        [(100 * RANK + r * local + j, float(r * local + j)) for j in range(local)] for r in range(3)
    ]
    assert each_replica(strategy, await strategy.run(lambda: 1)) == [1] * local


@pytest.mark.parametrize("local", [1, 2])
async def test_from_function_per_replica_pipelines(make_strategy: MakeStrategy, local: int) -> None:
    """InputReplicationMode.PER_REPLICA: dataset_fn runs once per local replica, with the
    replica's global id as its pipeline of W * L, and each replica gets its own dataset's
    batches."""
    strategy = make_strategy(local)
    n = WORKERS * local
    contexts: list[InputContext] = []

    def dataset_fn(context: InputContext) -> Any:
        contexts.append(context)
        return [np.full(2, 100 * context.input_pipeline_id + i) for i in range(3)]

    options = aioreplica.InputOptions(experimental_replication_mode="per_replica")
    got = [
        [v.tolist() for v in strategy.experimental_local_results(e)]
        async for e in strategy.distribute_datasets_from_function(dataset_fn, options)
    ]
    assert [(c.num_input_pipelines, c.input_pipeline_id) for c in contexts] == [
        (n, g) for g in global_ids(local)
    ]
    assert got == [[[100 * g + i] * 2 for g in global_ids(local)] for i in range(3)]


async def test_run_steps_over_every_worker(make_strategy: MakeStrategy) -> None:
    """run_steps across workers: every worker's replicas get their slices of the same global
    batches, the step's collectives span every worker, and the workers stop together when the
    data ends (a partial last batch: 20 rows in batches of 8), short of ``steps``."""
    strategy = make_strategy(2)
    iterator = aiter(strategy.distribute_dataset(global_batches(20, 8)))
    totals: list[tuple[int, float]] = []

    async def step(element: Table) -> float:
        labels = element[1]
        total = await replica_context().all_reduce("sum", np.array([float(labels.sum())]))
        totals.append((int(labels.size), float(total[0])))
        return float(total[0])

    result = await strategy.run_steps(step, iterator, 10)
    replicas = 2 * WORKERS
    expected = [
        (len(rows), float(sum(range(start, min(start + 8, 20)))))
        for start in range(0, 20, 8)
        for rows in np.array_split(np.arange(start, min(start + 8, 20)), replicas)[
            RANK * 2 : RANK * 2 + 2
        ]
    ]
    assert sorted(totals) == sorted(expected)
    assert each_replica(strategy, result) == [70.0, 70.0]  # rows 16 to 19


async def test_run_steps_on_iterator_over_every_worker(make_strategy: MakeStrategy) -> None:
    """experimental_run_steps_on_iterator across workers: fn runs once per step on every
    worker, its run() spans every worker, and a reduced output is the global one."""
    strategy = make_strategy(2)
    iterator = aiter(strategy.distribute_dataset(global_batches(16, 8)))

    async def fn(context: Any, inputs: Table) -> None:
        sums = await strategy.run(lambda element: float(element[1].sum()), args=(inputs,))
        await context.set_last_step_output("total", sums, reduce_op="sum")

    context = await strategy.extended.experimental_run_steps_on_iterator(fn, iterator, 5)
    assert float(context.last_step_outputs["total"]) == float(sum(range(8, 16)))


#: Arguments that ``run_steps`` (or the older loop) refuses: how to make the call, given the
#: strategy, an iterator and whether this worker passes them; and the error.
BAD_STEPS: dict[str, tuple[Any, type[Exception]]] = {
    "run_steps steps": (
        lambda s, it, bad: s.run_steps(lambda x: None, it, -1 if bad else 1),
        ValueError,
    ),
    "run_steps step_fn": (
        lambda s, it, bad: s.run_steps(None if bad else (lambda x: None), it, 1),
        TypeError,
    ),
    "run_steps iterator": (
        lambda s, it, bad: s.run_steps(lambda x: None, [1, 2] if bad else it, 1),
        TypeError,
    ),
    "run_steps_on_iterator iterations": (
        lambda s, it, bad: s.extended.experimental_run_steps_on_iterator(
            lambda context, x: None, it, "one" if bad else 1
        ),
        TypeError,
    ),
}


@pytest.mark.parametrize("every", [True, False], ids=["every worker", "one worker"])
@pytest.mark.parametrize("case", list(BAD_STEPS))
async def test_bad_run_steps_arguments_raise_on_every_worker(
    make_strategy: MakeStrategy, case: str, every: bool
) -> None:
    """Arguments that run_steps refuses, on every worker or on one: the workers raise in step
    (the refusing ones their own error, the others a ValueError naming the last worker) before
    any pull from the iterator, and the strategy and the iterator go on working."""
    strategy = make_strategy(2)
    call, error = BAD_STEPS[case]
    bad = every or RANK == WORKERS - 1
    async with aiter(strategy.distribute_dataset(global_batches(8, 8))) as iterator:
        with pytest.raises(error if bad else ValueError) as caught:
            await call(strategy, iterator, bad)
        if not bad:
            assert f"worker {WORKERS - 1}: " in str(caught.value), str(caught.value)
        rows = await strategy.run_steps(lambda element: int(element[1].size), iterator, 1)
    assert each_replica(strategy, rows) == [2, 2]


async def test_run_during_the_agreement_to_start_run_steps_is_refused(
    make_strategy: MakeStrategy,
) -> None:
    """While a worker's run_steps waits for the others to agree that they accepted their
    arguments, a run() started beside it is refused (its collectives could reach MPI before
    the agreement's on one worker and after it on another); the run_steps then completes."""
    strategy = make_strategy(2)
    go = WORLD.Dup()  # rank 0 tells the others when to start their run_steps
    refused: list[str] = []
    results: list[Any] = []

    async def loop() -> None:
        results.append(await strategy.run_steps(lambda b: int(b[1].size), iterator, 1))

    async with (
        aiter(strategy.distribute_dataset(global_batches(8, 8))) as iterator,
        anyio.create_task_group() as tg,
    ):
        if RANK == 0:
            tg.start_soon(loop)
            await anyio.wait_all_tasks_blocked()  # the loop waits for the others
            with pytest.raises(RuntimeError, match="another run"):
                await strategy.run(lambda: None)
            refused.append("run()")
            for peer in range(1, WORKERS):
                go.send(None, dest=peer)
        else:
            await anyio.to_thread.run_sync(go.recv, None, 0)
            tg.start_soon(loop)
    go.Free()
    assert refused == (["run()"] if RANK == 0 else [])
    assert each_replica(strategy, results[0]) == [2, 2]


async def test_a_worker_that_stops_pulling_is_named_in_the_passs_agreement(
    make_strategy: MakeStrategy,
) -> None:
    """Worker 1 takes its first batch of a pass and stops pulling, its iterator still open,
    while worker 0 goes on (no prefetching, so worker 1 makes no agreement ahead): worker 0's
    wait under ``sync_timeout`` names the pass's agreement on its next batch, not a
    collective the program never made, and worker 1 as the late worker."""
    strategy = make_strategy(1, sync_timeout=0.5)
    outcome: Any = "done"
    iterator = aiter(strategy.distribute_dataset(batched(np.arange(8.0), 2), prefetch=0))
    try:
        while True:
            batch = await iterator.get_next()
            await strategy.run(lambda x: x, args=(batch,))
            if RANK == 1:
                break
    except aioreplica.ReplicaSyncError as exc:
        outcome = (str(exc).split(";")[0], exc.workers)
    assert allgather(outcome) == [
        (
            "worker 0 waited 0.5 s in a dataset pass's agreement on its next batch for worker "
            "1, which did not arrive",
            (1,),
        ),
        "done",
    ]
    await iterator.aclose()


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("how", ["break", "cancel"])
async def test_a_worker_leaving_a_pass_early_ends_it_on_the_others(
    make_strategy: MakeStrategy, how: str, prefetch: int
) -> None:
    """Worker 1 leaves a pass after its second batch (a ``break``, or its next wait
    cancelled) while worker 0 goes on, with no ``sync_timeout``: worker 0's pass raises
    ReplicaSyncError naming worker 1 at its first agreement on a batch that worker 1 did not
    make, instead of waiting for it for ever; nothing breaks, and both workers go on with
    ``run()`` and a new pass."""
    strategy = make_strategy(2)
    batches = [np.full((4, 2), float(i)) for i in range(12)]
    taken = 0
    outcome: Any = "left"
    with anyio.fail_after(20):
        if RANK == 1:
            with anyio.CancelScope() as scope:
                async for _ in strategy.distribute_dataset(batches, prefetch=prefetch):
                    taken += 1
                    if taken == 2:
                        if how == "break":
                            break
                        scope.cancel()  # the wait for the next batch is given up
        else:
            try:
                async for _ in strategy.distribute_dataset(batches, prefetch=prefetch):
                    taken += 1
            except aioreplica.ReplicaSyncError as exc:
                outcome = (str(exc).split(" (")[0], exc.workers)
        # (A pass that nothing closed, dropped after a ``break``, is told of at worker 1's
        # next wait for the others: this run()'s.)
        assert each_replica(strategy, await strategy.run(lambda: 1)) == [1, 1]
        everyone = allgather((taken, outcome))
        # Worker 0 takes the batches whose agreement worker 1 made (its prefetching's too).
        assert everyone[1] == (2, "left")
        assert 2 <= everyone[0][0] <= 3 + prefetch
        assert everyone[0][1] == ("worker 1 left a dataset pass", (1,))
        again = [element async for element in strategy.distribute_dataset(batches[:2])]
        assert len(again) == 2


async def test_a_pass_whose_wait_was_given_up_is_refused_there_and_ends_on_the_others(
    make_strategy: MakeStrategy,
) -> None:
    """With no prefetching, worker 1 gives up a wait for its next batch (a timeout) while
    worker 0 is held up: that pass cannot go on across workers (the agreement it left cannot
    be cancelled), so its next wait raises RuntimeError saying to start a new pass, instead
    of an MPI error or a pairing with the wrong agreement; worker 0's pass raises
    ReplicaSyncError naming worker 1 within a batch; both go on with ``run()``."""
    strategy = make_strategy(1)
    iterator = aiter(strategy.distribute_dataset(batched(np.arange(16.0), 2), prefetch=0))
    outcome: Any = None
    with anyio.fail_after(20):
        await iterator.get_next()
        if RANK == 1:
            with anyio.move_on_after(0.3) as timeout:
                await iterator.get_next()  # worker 0 is in the barrier below meanwhile
            with pytest.raises(RuntimeError, match=r"left a dataset pass.*start a new pass"):
                await iterator.get_next()
            outcome = timeout.cancelled_caught
            WORLD.Barrier()
        else:
            WORLD.Barrier()  # (blocks this worker's loop: worker 1 gives up meanwhile)
            taken = 0
            try:
                while True:
                    await iterator.get_next()
                    taken += 1
            except aioreplica.ReplicaSyncError as exc:
                outcome = (taken <= 1, str(exc).split(" (")[0], exc.workers)
        assert allgather(outcome) == [(True, "worker 1 left a dataset pass", (1,)), True]
        assert each_replica(strategy, await strategy.run(lambda: 1)) == [1]


async def test_a_pass_left_before_a_slower_worker_starts_it_ends_there_too(
    make_strategy: MakeStrategy,
) -> None:
    """Worker 1 starts a pass and leaves it before its first batch, before worker 0 has even
    started it: worker 0 keeps what worker 1 said of a pass it has yet to make, and its pass
    raises ReplicaSyncError naming worker 1 instead of waiting for ever."""
    strategy = make_strategy(1)
    dataset = strategy.distribute_dataset(batched(np.arange(8.0), 2))
    outcome: Any = "left"
    with anyio.fail_after(20):
        if RANK == 1:
            async with aiter(dataset):
                pass  # leaves before its first batch
            WORLD.Barrier()
        else:
            WORLD.Barrier()  # worker 1 has left the pass before this worker starts it
            try:
                async for _ in dataset:
                    pass
            except aioreplica.ReplicaSyncError as exc:
                outcome = (str(exc).split(" (")[0], exc.workers)
        assert allgather(outcome) == [("worker 1 left a dataset pass", (1,)), "left"]
        assert each_replica(strategy, await strategy.run(lambda: 1)) == [1]
