"""Known hangs and silent corruptions of Horovod, PyTorch DDP and TF's MultiWorkerMirroredStrategy,
replayed against ``aioreplica.MultiWorkerMirroredStrategy`` in two ranks.

Each test makes the two workers do something different (the classic ways those libraries hang
or mix up data) and asserts what each rank saw: a clear error on every rank, naming what
differs, within seconds, or the right numbers. Outcomes are gathered on every rank with
``allgather`` so each rank asserts the whole picture.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

import aioreplica
from aioreplica import Checkpoint, Variable
from aioreplica.optimizers import SGD
from aioreplica.testing import replica_context
from multiworker.mwtools import RANK, allgather, assert_in_step, each_replica, shared_directory

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio


async def outcome(call: Callable[[], Awaitable[Any]]) -> tuple[str, str, float]:
    """(exception type name or "ok", message or repr of the result, seconds)."""
    start = time.monotonic()
    try:
        result = await call()
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", repr(result), time.monotonic() - start


def errors_on_every_rank(outcomes: list[tuple[str, str, float]], *kinds: str) -> None:
    for rank, (kind, message, seconds) in enumerate(outcomes):
        assert kind in kinds, f"rank {rank}: {kind}: {message}"
        assert seconds < 10, f"rank {rank} took {seconds:.1f} s"


# -- 1. collectives in a different order on each rank (Horovod "mismatched order" hang) --------


async def test_collectives_in_another_order_raise_on_every_worker(
    make_strategy: MakeStrategy,
) -> None:
    """Worker 0 makes an all_reduce then an all_gather; worker 1 the all_gather first. Horovod
    stalls ("tensors ... submitted in a different order"): here both raise a ValueError naming
    both calls, and the strategy goes on working."""
    strategy = make_strategy()

    async def step() -> Any:
        ctx = replica_context()
        x = np.ones(3)
        if RANK == 0:
            a = await ctx.all_reduce("sum", x)
            b = await ctx.all_gather(x, axis=0)
        else:
            b = await ctx.all_gather(x, axis=0)
            a = await ctx.all_reduce("sum", x)
        return a, b

    outcomes = allgather(await outcome(lambda: strategy.run(step)))
    errors_on_every_rank(outcomes, "ValueError", "WorkersDisagree")
    for _, message, _ in outcomes:
        assert "all_reduce" in message, message
        assert "all_gather" in message, message
    await assert_in_step(strategy)


# -- 2. a data-dependent branch around a collective (DDP "unused parameters" / skip hang) ------


async def test_a_collective_in_a_branch_taken_on_one_worker_only(
    make_strategy: MakeStrategy,
) -> None:
    """A replica all-reduces only when its loss is large; only worker 1's are. DDP hangs in the
    next allreduce; here both workers raise (one more collective on one worker), and the next
    step works and sums correctly."""
    strategy = make_strategy()

    async def step() -> Any:
        ctx = replica_context()
        loss = float(RANK) * 10.0
        if loss > 5:
            loss = await ctx.all_reduce("sum", loss)
        return loss

    outcomes = allgather(await outcome(lambda: strategy.run(step)))
    errors_on_every_rank(outcomes, "ValueError", "WorkersDisagree")
    await assert_in_step(strategy)


async def test_an_optimizer_step_on_one_worker_only(make_strategy: MakeStrategy) -> None:
    """Gradient clipping gone wrong: worker 1 skips ``apply_gradients`` on a NaN loss, worker 0
    applies. Every worker raises; the variable is the same on both afterwards (no half update)."""
    strategy = make_strategy()
    with strategy.scope():
        w = Variable(np.zeros(2), name="w")
    optimizer = SGD(0.5)

    async def step() -> None:
        if RANK == 0:
            await optimizer.apply_gradients([(np.ones(2), w)])

    outcomes = allgather(await outcome(lambda: strategy.run(step)))
    errors_on_every_rank(outcomes, "ValueError", "WorkersDisagree", "ReplicaSyncError")
    # Whatever happened, the copies must be the same on every worker (no half update).
    copies = allgather([np.asarray(c).tolist() for c in w.values])
    assert copies[0] == copies[1], copies


# -- 3. different dtype / op / shape per rank (Horovod "mismatched dtype" / NCCL garbage) ------


@pytest.mark.parametrize(
    ("mine", "theirs"),
    [
        (np.float32(1.0), np.float64(1.0)),
        (1, 1.0),  # an int on one worker, a float on the other
        (True, 1),  # a bool on one worker, an int on the other
        (np.zeros((2, 3)), np.zeros((3, 2))),  # same size, another shape
        (np.zeros(0), np.zeros(3)),  # an empty gradient on one worker
        ((1.0, 2.0), [1.0, 2.0]),  # a tuple on one worker, a list on the other
    ],
    ids=["f32-f64", "int-float", "bool-int", "transposed", "empty", "tuple-list"],
)
async def test_all_reduce_of_another_kind_of_value_per_worker(
    make_strategy: MakeStrategy, mine: Any, theirs: Any
) -> None:
    """Each pair of values differs between the workers in dtype, shape or structure: Horovod
    reports a mismatch (or NCCL silently sums garbage). Here both workers raise, or both get
    the same correct total; never a different number on each worker."""
    strategy = make_strategy()

    async def step() -> Any:
        total = await replica_context().all_reduce("sum", mine if RANK == 0 else theirs)
        return [np.asarray(leaf).tolist() for leaf in aioreplica.nest.flatten(total)]

    got = await outcome(lambda: strategy.run(step))
    outcomes = allgather(got[:2])
    kinds = {kind for kind, _ in outcomes}
    if "ok" in kinds:  # both succeed, with the same result everywhere
        assert kinds == {"ok"}, outcomes
        assert outcomes[0][1] == outcomes[1][1], outcomes
    else:  # both raise: a refusal on one, a WorkersDisagree naming it on the other
        assert kinds <= {"ValueError", "WorkersDisagree", "TypeError"}, outcomes
    await assert_in_step(strategy)


# -- 4. one rank makes one run() more (DDP "uneven inputs" hang) --------------------------------


async def test_one_more_run_on_one_worker_then_a_reduce(make_strategy: MakeStrategy) -> None:
    """Worker 1 has one batch more and runs one more step; then both reduce a metric. The extra
    step meets worker 0's reduce: both raise a WorkersDisagree, in seconds; nothing hangs."""
    strategy = make_strategy()

    async def step() -> Any:
        return await replica_context().all_reduce("sum", 1.0)

    async def program() -> Any:
        await strategy.run(step)
        if RANK == 1:
            await strategy.run(step)
        return await strategy.reduce("sum", np.float64(2.0), axis=None)

    outcomes = allgather(await outcome(program))
    errors_on_every_rank(outcomes, "WorkersDisagree", "ValueError")


# -- 5. a merge_fn raising on one rank after its cross-worker reduce ----------------------------


async def test_merge_fn_raising_after_its_reduce_on_one_worker(make_strategy: MakeStrategy) -> None:
    """A merge_fn reduces across workers, then raises on worker 1 only (a metric's bad update).
    Worker 1 raises its error; worker 0 a ReplicaSyncError naming worker 1 and the error."""
    strategy = make_strategy()

    class MetricBroke(RuntimeError):
        pass

    async def merge_fn(distribution: Any, value: Any) -> Any:
        total = await distribution.reduce("sum", value, axis=None)
        if RANK == 1:
            raise MetricBroke("metric update failed on worker 1")
        return total

    async def step() -> Any:
        return await replica_context().merge_call(merge_fn, args=(1.0,))

    outcomes = allgather(await outcome(lambda: strategy.run(step)))
    assert outcomes[1][0] == "MetricBroke", outcomes
    assert outcomes[0][0] == "ReplicaSyncError", outcomes
    assert "worker 1" in outcomes[0][1], outcomes
    assert "metric update failed" in outcomes[0][1], outcomes
    assert max(s for _, _, s in outcomes) < 10, outcomes


# -- 6. variables that differ per rank (TF "variable created on one worker") -------------------


async def test_an_extra_variable_on_one_worker(make_strategy: MakeStrategy) -> None:
    """Worker 1's model builds one more layer (a variable more). The next step raises the same
    ValueError on every worker, not a hang nor a step on mismatched weights."""
    strategy = make_strategy()
    with strategy.scope():
        w = Variable(np.zeros(2), name="w")
        if RANK == 1:
            Variable(np.zeros(2), name="extra")
        v = Variable(np.ones(2), name="v")

    async def step() -> Any:
        return w.value() + v.value()

    outcomes = allgather(await outcome(lambda: strategy.run(step)))
    errors_on_every_rank(outcomes, "ValueError", "WorkersDisagree")


async def test_a_variable_of_another_shape_on_one_worker(make_strategy: MakeStrategy) -> None:
    """A layer sized from local data: worker 1's kernel is (3,) where worker 0's is (2,). Its
    first use raises on every worker, naming the shapes."""
    strategy = make_strategy()
    with strategy.scope():
        w = Variable(np.zeros(2 + RANK), name="kernel")

    async def step() -> Any:
        return w.value().sum()

    outcomes = allgather(await outcome(lambda: strategy.run(step)))
    errors_on_every_rank(outcomes, "ValueError", "WorkersDisagree")
    for _, message, _ in outcomes:
        assert "(2,)" in message, message
        assert "(3,)" in message, message


async def test_an_exception_in_scope_on_one_worker(make_strategy: MakeStrategy) -> None:
    """Model building raises on worker 1 halfway through ``strategy.scope()`` (caught by the
    program, which goes on); worker 0 built one variable more. The next step raises on every
    worker; then the scope still works on both (no scope left entered)."""
    strategy = make_strategy()
    with strategy.scope():
        w = Variable(np.zeros(2), name="w")
    try:
        with strategy.scope():
            if RANK == 1:
                raise OSError("pretrained weights missing on worker 1")
            Variable(np.zeros(2), name="b")
    except OSError:
        pass
    assert not aioreplica.has_strategy()

    async def step() -> Any:
        return w.value().sum()

    outcomes = allgather(await outcome(lambda: strategy.run(step)))
    errors_on_every_rank(outcomes, "ValueError", "WorkersDisagree")


# -- 7. checkpoints on one rank only, or another file per rank ---------------------------------


async def test_a_save_on_the_chief_only_then_a_step(make_strategy: MakeStrategy) -> None:
    """``if is_chief: await checkpoint.save(...)`` (TF's classic MWMS hang): the chief's save
    meets worker 1's next step. Both raise, in seconds."""
    strategy = make_strategy()
    with strategy.scope():
        w = Variable(np.zeros(2), name="w")

    async def step() -> Any:
        return await replica_context().all_reduce("sum", w.value())

    with shared_directory() as path:
        checkpoint = Checkpoint(w=w)

        async def program() -> Any:
            if strategy.cluster.is_chief:
                await checkpoint.save(f"{path}/ckpt")
            return await strategy.run(step)

        outcomes = allgather(await outcome(program))
    errors_on_every_rank(outcomes, "WorkersDisagree", "ValueError", "ReplicaSyncError")


async def test_restoring_another_checkpoint_on_each_worker(make_strategy: MakeStrategy) -> None:
    """Each worker restores a different file (the newest checkpoint found in a local folder):
    every worker raises, and no worker restored anything (the weights stay identical)."""
    strategy = make_strategy()
    with strategy.scope():
        w = Variable(np.zeros(2), name="w")
    checkpoint = Checkpoint(w=w)
    with shared_directory() as path:
        await w.assign(np.full(2, 1.0))
        first = await checkpoint.save(f"{path}/a")
        await w.assign(np.full(2, 2.0))
        second = await checkpoint.save(f"{path}/b")
        await w.assign(np.full(2, 3.0))
        outcomes = allgather(
            (await outcome(lambda: checkpoint.restore(first if RANK == 0 else second)))[:2]
        )
        values = allgather(w.numpy().tolist())
    assert [kind for kind, _ in outcomes] != ["ok", "ok"], outcomes
    assert values[0] == values[1] == [3.0, 3.0], values


# -- 8. sync_timeout with a rank blocked in synchronous code ------------------------------------


@pytest.mark.timeout(30)
async def test_sync_timeout_with_a_worker_blocked_in_synchronous_code(
    make_strategy: MakeStrategy,
) -> None:
    """Worker 1 blocks its event loop for 4 s (a synchronous data loader) before its step;
    sync_timeout=1: worker 0 raises a ReplicaSyncError naming worker 1 within about a second or
    two, not after worker 1 wakes; worker 1 raises too when it gets there."""
    strategy = make_strategy(sync_timeout=1.0)

    async def step() -> Any:
        if RANK == 1 and replica_context().replica_id_in_sync_group == 2:
            time.sleep(4)  # blocks the whole loop  # noqa: ASYNC251 (blocking on purpose)
        return await replica_context().all_reduce("sum", 1.0)

    outcomes = allgather(await outcome(lambda: strategy.run(step)))
    assert outcomes[0][0] == "ReplicaSyncError", outcomes
    assert "worker 1" in outcomes[0][1], outcomes
    assert outcomes[0][2] < 3.5, outcomes
    assert outcomes[1][0] == "ReplicaSyncError", outcomes


# -- 9. uneven input pipelines (DDP join / TF MWMS "uneven data hangs") --------------------------


async def test_uneven_shards_from_function_end_together(make_strategy: MakeStrategy) -> None:
    """Each worker reads its own shard, worker 1's two batches longer. Both workers make the
    same number of steps (TF MWMS and DDP hang here), every step's all_reduce gives the same
    total on both workers, and the zero-row replicas count as zero."""
    strategy = make_strategy()

    def dataset_fn(ctx: aioreplica.InputContext) -> Any:
        count = 3 + 2 * ctx.input_pipeline_id
        return [np.ones((4, 1)) * (k + 1) for k in range(count)]

    async def step(batch: Any) -> Any:
        return await replica_context().all_reduce("sum", float(np.sum(batch)))

    totals: list[float] = []
    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    with anyio.fail_after(15):
        async for batch in dataset:
            result = await strategy.run(step, (batch,))
            totals.append(float(each_replica(strategy, result)[0]))
    everyone = allgather(totals)
    assert everyone[0] == everyone[1], everyone
    assert len(everyone[0]) >= 3, everyone


# -- 10. KeyboardInterrupt in a replica on one worker ---------------------------------------------


async def test_keyboard_interrupt_in_a_replica_on_one_worker(make_strategy: MakeStrategy) -> None:
    """Ctrl-C reaches worker 1 while its replica runs (a KeyboardInterrupt raised there). Worker
    1's run() lets the KeyboardInterrupt out; worker 0 raises a ReplicaSyncError naming worker
    1 within seconds, instead of waiting in the all_reduce forever."""
    strategy = make_strategy()

    async def step() -> Any:
        ctx = replica_context()
        if RANK == 1 and ctx.replica_id_in_sync_group == 3:
            raise KeyboardInterrupt
        return await ctx.all_reduce("sum", 1.0)

    start = time.monotonic()
    try:
        await strategy.run(step)
        mine: tuple[str, str, float] = ("ok", "", time.monotonic() - start)
    except KeyboardInterrupt:
        mine = ("KeyboardInterrupt", "", time.monotonic() - start)
    except BaseException as exc:
        mine = (type(exc).__name__, str(exc), time.monotonic() - start)
    outcomes = allgather(mine)
    assert outcomes[1][0] == "KeyboardInterrupt", outcomes
    assert outcomes[0][0] == "ReplicaSyncError", outcomes
    assert "worker 1" in outcomes[0][1], outcomes
    assert outcomes[0][2] < 10, outcomes


# -- 11. broadcast with another shape on each worker (no error expected: the source wins) -------


async def test_broadcast_of_other_shapes_takes_the_sources(make_strategy: MakeStrategy) -> None:
    """Horovod's broadcast_parameters with differently shaped buffers corrupts memory; here a
    broadcast needs only the same structure, and every replica gets the source's array."""
    strategy = make_strategy()

    async def step() -> Any:
        value = np.arange(3.0) if RANK == 0 else np.zeros((2, 2), np.float32)
        return await replica_context().broadcast(value, source_replica=0)

    result = await strategy.run(step)
    got = [np.asarray(r) for r in each_replica(strategy, result)]
    everyone = allgather([(g.dtype.str, g.tolist()) for g in got])
    for rank in range(2):
        for dtype, values in everyone[rank]:
            assert (dtype, values) == (np.dtype(np.float64).str, [0.0, 1.0, 2.0]), everyone


# -- 12. a strategy.gather of other trailing shapes ----------------------------------------------


async def test_gather_outside_run_with_other_trailing_shapes(make_strategy: MakeStrategy) -> None:
    """An evaluation loop gathers predictions whose width depends on local data. Both workers
    raise a ValueError naming both shapes; then the strategy still works."""
    strategy = make_strategy()
    values = aioreplica.PerReplica([np.zeros((2, 3 + RANK)), np.zeros((2, 3 + RANK))])
    outcomes = allgather((await outcome(lambda: strategy.gather(values, axis=0)))[:2])
    for kind, _message in outcomes:
        assert kind in ("ValueError", "WorkersDisagree"), outcomes
    await assert_in_step(strategy)


# -- 13. one worker leaves a dataset pass early (DDP "break out of the loop" hang) -------------


@pytest.mark.timeout(30)
async def test_one_worker_breaks_out_of_a_pass_early(make_strategy: MakeStrategy) -> None:
    """Worker 1 stops its epoch after 2 steps (``break``, an early-stopping check on local
    data) and reduces a metric; worker 0 goes on to its third step. Both raise within seconds
    (worker 0's next agreement on the pass, or its step, meets worker 1's reduce), instead of
    worker 0 waiting forever for a peer that left the pass."""
    strategy = make_strategy()
    batches = [np.ones((4, 1)) * (k + 1) for k in range(6)]

    async def step(batch: Any) -> Any:
        return await replica_context().all_reduce("sum", float(np.sum(batch)))

    async def program() -> Any:
        steps = 0
        async for batch in strategy.distribute_dataset(batches):
            await strategy.run(step, (batch,))
            steps += 1
            if RANK == 1 and steps == 2:
                break
        return await strategy.reduce("sum", np.float64(steps), axis=None)

    with anyio.move_on_after(20) as scope:
        mine = await outcome(program)
    outcomes = allgather((*mine, scope.cancelled_caught))
    for rank, (kind, _message, seconds, timed_out) in enumerate(outcomes):
        assert not timed_out, f"rank {rank} still waiting after 20 s"
        assert kind != "ok", outcomes
        assert seconds < 10, outcomes


# -- 14. a strategy closed on one worker only --------------------------------------------------


async def test_a_run_after_close_on_one_worker(make_strategy: MakeStrategy) -> None:
    """Worker 1 closes its strategy (its cleanup ran early), then both run a step: worker 1
    raises its closed error, worker 0 a ValueError naming worker 1, in seconds."""
    strategy = make_strategy()
    if RANK == 1:
        strategy.close()

    async def step() -> Any:
        return await replica_context().all_reduce("sum", 1.0)

    with anyio.move_on_after(15) as scope:
        mine = await outcome(lambda: strategy.run(step))
    outcomes = allgather((*mine, scope.cancelled_caught))
    for rank, (kind, _message, _seconds, timed_out) in enumerate(outcomes):
        assert not timed_out, f"rank {rank} still waiting after 15 s: {outcomes}"
        assert kind != "ok", outcomes
    assert "worker 1" in outcomes[0][1], outcomes


# -- 15. a write outside run() on one worker only ------------------------------------------------


async def test_an_assign_on_the_chief_only_then_a_step(make_strategy: MakeStrategy) -> None:
    """``if is_chief: await w.assign(loaded)`` (a warm start on the chief only): the chief's
    write meets worker 1's step. Both raise; no worker trained on different weights."""
    strategy = make_strategy()
    with strategy.scope():
        w = Variable(np.zeros(2), name="w")

    async def step() -> Any:
        return await replica_context().all_reduce("sum", w.value())

    async def program() -> Any:
        if strategy.cluster.is_chief:
            await w.assign(np.full(2, 5.0))
        result = await strategy.run(step)
        return [np.asarray(r).tolist() for r in each_replica(strategy, result)]

    with anyio.move_on_after(15) as scope:
        mine = await outcome(program)
    outcomes = allgather((*mine, scope.cancelled_caught))
    for rank, (_kind, _message, _seconds, timed_out) in enumerate(outcomes):
        assert not timed_out, f"rank {rank} still waiting after 15 s: {outcomes}"
    kinds = {o[0] for o in outcomes}
    assert kinds.isdisjoint({"ok"}) or outcomes[0][1] == outcomes[1][1], outcomes


# -- 16. restore on one worker only ----------------------------------------------------------------


async def test_a_restore_on_one_worker_only_then_a_step(make_strategy: MakeStrategy) -> None:
    """Worker 1 alone restores a checkpoint (a resume check on a local flag): its restore meets
    worker 0's step. Both raise in seconds; the weights stay the same on both workers."""
    strategy = make_strategy()
    with strategy.scope():
        w = Variable(np.zeros(2), name="w")
    checkpoint = Checkpoint(w=w)

    async def step() -> Any:
        return await replica_context().all_reduce("sum", w.value())

    with shared_directory() as path:
        await w.assign(np.full(2, 1.0))
        saved = await checkpoint.save(f"{path}/c")
        await w.assign(np.full(2, 2.0))

        async def program() -> Any:
            if RANK == 1:
                await checkpoint.restore(saved)
            return await strategy.run(step)

        with anyio.move_on_after(15) as scope:
            mine = await outcome(program)
        outcomes = allgather((*mine, scope.cancelled_caught))
    for rank, (kind, _message, _seconds, timed_out) in enumerate(outcomes):
        assert not timed_out, f"rank {rank} still waiting after 15 s: {outcomes}"
        assert kind != "ok", outcomes
    values = allgather([np.asarray(c).tolist() for c in w.values])
    assert values[0] == values[1], values


# -- 17. a collective read on the chief only (TF: `if is_chief: print(metric.result())`) ------


async def test_a_sync_on_read_read_on_the_chief_only(make_strategy: MakeStrategy) -> None:
    """The chief logs a sync-on-read metric (a collective read) while worker 1 goes on to its
    next step: TF MWMS hangs. Both raise in seconds; neither returns a wrong total."""
    strategy = make_strategy()
    with strategy.scope():
        metric = Variable(
            0.0,
            name="loss_sum",
            synchronization=aioreplica.VariableSynchronization.ON_READ,
            aggregation=aioreplica.VariableAggregation.SUM,
        )

    async def step() -> Any:
        await metric.assign_add(1.0)
        return await replica_context().all_reduce("sum", 1.0)

    await strategy.run(step)

    async def program() -> Any:
        if strategy.cluster.is_chief:
            return float(metric.numpy())
        return await strategy.run(step)

    with anyio.move_on_after(15) as scope:
        mine = await outcome(program)
    outcomes = allgather((*mine, scope.cancelled_caught))
    for rank, (kind, _message, _seconds, timed_out) in enumerate(outcomes):
        assert not timed_out, f"rank {rank} still waiting after 15 s: {outcomes}"
        assert kind != "ok", outcomes


async def test_a_first_read_on_the_chief_only(make_strategy: MakeStrategy) -> None:
    """The chief prints a new variable (its first read syncs it from the chief) while worker 1
    runs a step using it. Both raise, or both see the chief's value; never a step on another
    value."""
    strategy = make_strategy()
    with strategy.scope():
        w = Variable(np.full(2, float(RANK + 1)), name="w")

    async def step() -> Any:
        return await replica_context().all_reduce("sum", w.value())

    async def program() -> Any:
        if strategy.cluster.is_chief:
            w.numpy()
        result = await strategy.run(step)
        return [np.asarray(r).tolist() for r in each_replica(strategy, result)]

    with anyio.move_on_after(15) as scope:
        mine = await outcome(program)
    outcomes = allgather((*mine, scope.cancelled_caught))
    for rank, (_kind, _message, _seconds, timed_out) in enumerate(outcomes):
        assert not timed_out, f"rank {rank} still waiting after 15 s: {outcomes}"
    for kind, message, _, _ in outcomes:
        if kind == "ok":  # the chief's value, 1.0, on all 4 replicas
            assert message == repr([[4.0, 4.0], [4.0, 4.0]]), outcomes


# -- 18. packed leaves whose shapes are swapped between workers (Horovod fusion buffer) -------


@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
async def test_packed_leaves_with_swapped_shapes(make_strategy: MakeStrategy, op: str) -> None:
    """{"a": 2 elements, "b": 3} on worker 0, {"a": 3, "b": 2} on worker 1: one fused buffer
    of 5 elements either way. Horovod's fusion would mix the tensors; here both raise."""
    strategy = make_strategy()
    sizes = (2, 3) if RANK == 0 else (3, 2)
    value = {"a": np.arange(float(sizes[0])), "b": np.arange(float(sizes[1]))}

    async def step() -> Any:
        ctx = replica_context()
        if op == "all_reduce":
            return await ctx.all_reduce("sum", value)
        return await ctx.all_gather({k: v[None] for k, v in value.items()}, axis=0)

    outcomes = allgather((await outcome(lambda: strategy.run(step)))[:2])
    for kind, _ in outcomes:
        assert kind in ("ValueError", "WorkersDisagree"), outcomes
    await assert_in_step(strategy)


# -- 19. memory layout and byte order differing between workers (raw-buffer corruption) -------


@pytest.mark.parametrize(
    "layout", ["transposed-view", "reversed-view", "fortran", "big-endian", "strided"]
)
@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "broadcast"])
async def test_values_of_another_memory_layout_on_one_worker(
    make_strategy: MakeStrategy, layout: str, op: str
) -> None:
    """Worker 1 passes the same logical values in another memory layout (a transposed view, a
    reversed view, Fortran order, big-endian bytes, a strided slice); worker 0 a plain C array.
    A collective that sends raw buffers would sum or gather scrambled numbers; the right
    result is NumPy's on the logical values, on every worker."""
    strategy = make_strategy()
    base = np.arange(12.0).reshape(3, 4)

    def value() -> Any:
        if RANK == 0:
            return np.ascontiguousarray(base)
        if layout == "transposed-view":
            return np.ascontiguousarray(base.T).T
        if layout == "reversed-view":
            return np.ascontiguousarray(base[::-1])[::-1]
        if layout == "fortran":
            return np.asfortranarray(base)
        if layout == "big-endian":
            return base.astype(">f8")
        big = np.zeros((3, 8))
        big[:, ::2] = base
        return big[:, ::2]

    async def step() -> Any:
        ctx = replica_context()
        x = value()
        if op == "all_reduce":
            return await ctx.all_reduce("sum", x)
        if op == "all_gather":
            return await ctx.all_gather(x, axis=0)
        return await ctx.broadcast(x, source_replica=3)  # worker 1's second replica

    result = await strategy.run(step)
    got = [np.asarray(r, dtype=np.float64).tolist() for r in each_replica(strategy, result)]
    if op == "all_reduce":
        expected = (base * 4).tolist()
    elif op == "all_gather":
        expected = np.concatenate([base] * 4).tolist()
    else:
        expected = base.tolist()
    everyone = allgather(got)
    for rank in range(2):
        assert everyone[rank] == [expected, expected], (rank, everyone[rank])


# -- 20. strategy.reduce MEAN over uneven rows per worker (DDP's uneven last batch) -----------


async def test_mean_over_uneven_rows_per_worker(make_strategy: MakeStrategy) -> None:
    """Worker 0's replicas hold 3 and 3 rows, worker 1's 1 and 0 (the last, partial batch).
    ``strategy.reduce("mean", ..., axis=0)`` is the mean of all 7 rows, on both workers."""
    strategy = make_strategy()
    rows = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]] if RANK == 0 else [[7.0], []]
    values = aioreplica.PerReplica([np.array(r) for r in rows])
    mean = await strategy.reduce("mean", values, axis=0)
    everyone = allgather(float(mean))
    assert everyone == [4.0, 4.0], everyone
    gathered = await strategy.gather(values, axis=0)
    everyone = allgather(np.asarray(gathered).tolist())
    assert everyone[0] == everyone[1] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], everyone


# -- 21. sync_timeout on one worker only, the other late in synchronous code -----------------


@pytest.mark.timeout(30)
async def test_sync_timeout_set_on_one_worker_only(make_strategy: MakeStrategy) -> None:
    """Worker 0 has sync_timeout=1, worker 1 none (another config file); worker 1 blocks its
    loop 3 s before its collective. Worker 0 raises naming worker 1 in about a second; worker
    1, on arriving, must raise too (never go on alone with a step worker 0 gave up)."""
    strategy = make_strategy(sync_timeout=1.0 if RANK == 0 else None)

    async def step() -> Any:
        if RANK == 1 and replica_context().replica_id_in_sync_group == 2:
            time.sleep(3)  # noqa: ASYNC251 (blocking on purpose)
        return await replica_context().all_reduce("sum", 1.0)

    with anyio.move_on_after(15) as scope:
        mine = await outcome(lambda: strategy.run(step))
    outcomes = allgather((*mine, scope.cancelled_caught))
    for rank, (kind, _message, _seconds, timed_out) in enumerate(outcomes):
        assert not timed_out, f"rank {rank} still waiting after 15 s: {outcomes}"
        assert kind == "ReplicaSyncError", outcomes
    assert outcomes[0][2] < 2.5, outcomes


# -- 22. a synchronous merge_fn blocking on one worker, with sync_timeout --------------------


@pytest.mark.timeout(30)
async def test_sync_timeout_with_a_blocking_merge_fn_on_one_worker(
    make_strategy: MakeStrategy,
) -> None:
    """Worker 1's merge_fn blocks 4 s in synchronous code (a metric written to a slow disk);
    sync_timeout=1: worker 0, waiting at the end of run(), raises naming worker 1 in about a
    second; worker 1 raises too."""
    strategy = make_strategy(sync_timeout=1.0)

    def merge_fn(distribution: Any, value: Any) -> Any:
        if RANK == 1:
            time.sleep(4)
        return value

    async def step() -> Any:
        await replica_context().merge_call(merge_fn, args=(1.0,))
        return await replica_context().all_reduce("sum", 1.0)

    outcomes = allgather(await outcome(lambda: strategy.run(step)))
    assert outcomes[0][0] == "ReplicaSyncError", outcomes
    assert "worker 1" in outcomes[0][1], outcomes
    assert outcomes[0][2] < 3.5, outcomes
    assert outcomes[1][0] == "ReplicaSyncError", outcomes


# -- 23. concurrent collectives inside one replica (tasks the replica starts) -------------------


async def test_concurrent_collectives_in_a_replica_pair_by_identity(
    make_strategy: MakeStrategy,
) -> None:
    """Each replica all-reduces two gradients concurrently, from two tasks it starts (as an
    overlapped backward pass does): layer 1's is 1s, layer 2's 100s, same shape and dtype. Each
    total must be its own layer's (4 and 400), on every worker, every time; a pairing by
    arrival order would swap them silently where tasks start in no fixed order (trio)."""
    strategy = make_strategy()

    async def step() -> Any:
        ctx = replica_context()
        totals: dict[str, Any] = {}

        async def reduce(name: str, value: float) -> None:
            totals[name] = await ctx.all_reduce("sum", np.full(3, value))

        async with anyio.create_task_group() as tg:
            tg.start_soon(reduce, "layer1", 1.0)
            tg.start_soon(reduce, "layer2", 100.0)
        return float(totals["layer1"][0]), float(totals["layer2"][0])

    seen = []
    for _ in range(20):
        outcome_ = await outcome(lambda: strategy.run(step))
        seen.append(outcome_[:2])
        if outcome_[0] != "ok":
            break
    everyone = allgather(seen)
    for rank, results in enumerate(everyone):
        for kind, message in results:
            if kind == "ok":
                assert message == repr(((4.0, 400.0), (4.0, 400.0))), (rank, results)
            else:  # refusing concurrent collectives is fine, if both workers agree
                assert everyone[0][-1][0] != "ok", everyone
                assert everyone[1][-1][0] != "ok", everyone


# -- 24. both workers fail in the same step, with different errors ----------------------------


async def test_both_workers_failing_in_one_step(make_strategy: MakeStrategy) -> None:
    """Worker 0's replica raises ValueError and worker 1's KeyError, both before the all_reduce
    the others wait in: each worker raises (its own error or a ReplicaSyncError), in seconds."""
    strategy = make_strategy()

    async def step() -> Any:
        ctx = replica_context()
        if ctx.replica_id_in_sync_group % 2 == 1:
            raise (ValueError if RANK == 0 else KeyError)(f"bad batch on worker {RANK}")
        return await ctx.all_reduce("sum", 1.0)

    with anyio.move_on_after(15) as scope:
        mine = await outcome(lambda: strategy.run(step))
    outcomes = allgather((*mine, scope.cancelled_caught))
    for rank, (kind, _message, seconds, timed_out) in enumerate(outcomes):
        assert not timed_out, f"rank {rank} still waiting after 15 s: {outcomes}"
        assert kind in ("ValueError", "KeyError", "ReplicaSyncError"), outcomes
        assert seconds < 10, outcomes


# -- 25. a failure while the other worker moves a large (threaded) collective ---------------


@pytest.mark.timeout(60)
async def test_a_failure_during_a_large_collective_on_the_other_worker(
    make_strategy: MakeStrategy,
) -> None:
    """Worker 0 all-reduces 40 MiB (posted and polled on a worker thread); worker 1's replica
    raises before its part. Worker 0 raises a ReplicaSyncError naming worker 1 within
    seconds, instead of a thread waiting forever in MPI."""
    strategy = make_strategy()
    big = np.ones(5 * 2**20)  # 40 MiB of float64

    async def step() -> Any:
        ctx = replica_context()
        if RANK == 1:
            await anyio.sleep(0.5)
            raise ValueError("worker 1 ran out of data")
        total = await ctx.all_reduce("sum", big)
        return float(total[0])

    with anyio.move_on_after(30) as scope:
        mine = await outcome(lambda: strategy.run(step))
    outcomes = allgather((*mine, scope.cancelled_caught))
    assert not outcomes[0][3], f"rank 0 still waiting after 30 s: {outcomes}"
    assert outcomes[0][0] == "ReplicaSyncError", outcomes
    assert "worker 1" in outcomes[0][1], outcomes
    assert outcomes[0][2] < 10, outcomes
    assert outcomes[1][0] == "ValueError", outcomes


@pytest.mark.timeout(60)
async def test_sync_timeout_during_a_large_collective(make_strategy: MakeStrategy) -> None:
    """sync_timeout=1; worker 1 blocks 4 s in synchronous code before its part of a 40 MiB
    all_reduce that worker 0 polls on a thread. Worker 0 raises naming worker 1 within about a
    second or two; worker 1 raises when it arrives."""
    strategy = make_strategy(sync_timeout=1.0)
    big = np.ones(5 * 2**20)

    async def step() -> Any:
        ctx = replica_context()
        if RANK == 1 and ctx.replica_id_in_sync_group == 2:
            time.sleep(4)  # noqa: ASYNC251 (blocking on purpose)
        total = await ctx.all_reduce("sum", big)
        return float(total[0])

    with anyio.move_on_after(30) as scope:
        mine = await outcome(lambda: strategy.run(step))
    outcomes = allgather((*mine, scope.cancelled_caught))
    assert not outcomes[0][3], outcomes
    assert not outcomes[1][3], outcomes
    assert outcomes[0][0] == "ReplicaSyncError", outcomes
    assert outcomes[0][2] < 3.5, outcomes
    assert outcomes[1][0] == "ReplicaSyncError", outcomes


# -- 26. a BaseException of the program's own in a replica on one worker -------------------


class AbortTraining(BaseException):
    """A program's own BaseException (as some frameworks raise to stop a loop)."""


async def test_a_custom_base_exception_in_a_replica_on_one_worker(
    make_strategy: MakeStrategy,
) -> None:
    """Worker 1's replica raises a BaseException subclass of the program's own; worker 0 waits
    in the all_reduce. Worker 0 must raise a ReplicaSyncError naming worker 1 within seconds."""
    strategy = make_strategy()

    async def step() -> Any:
        ctx = replica_context()
        if RANK == 1 and ctx.replica_id_in_sync_group == 3:
            raise AbortTraining("stop requested on worker 1")
        return await ctx.all_reduce("sum", 1.0)

    start = time.monotonic()
    with anyio.move_on_after(15) as scope:
        try:
            await strategy.run(step)
            mine: tuple[str, str, float] = ("ok", "", time.monotonic() - start)
        except BaseException as exc:
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                raise
            mine = (type(exc).__name__, str(exc), time.monotonic() - start)
    outcomes = allgather((*mine, scope.cancelled_caught))
    assert not outcomes[0][3], f"rank 0 still waiting after 15 s: {outcomes}"
    assert outcomes[1][0] == "AbortTraining", outcomes
    assert outcomes[0][0] == "ReplicaSyncError", outcomes
    assert "worker 1" in outcomes[0][1], outcomes


# -- 27. bitwise identical float results on every worker (order of summation) ---------------


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "mean"])
async def test_float_reductions_are_bitwise_identical_on_every_worker(
    make_strategy: MakeStrategy, dtype: str, op: str
) -> None:
    """Floating-point sums depend on the order of their terms: a worker adding its own part
    first would get other bits than its peer, and mirrored weights would drift apart silently
    (a known NCCL/Gloo pitfall). Every replica of every worker gets the same bits."""
    strategy = make_strategy()
    rng = np.random.default_rng(7)
    values = (rng.normal(size=(4, 257)) * np.array([[1e4], [1e-3], [-1e4], [1.0]])).astype(dtype)

    async def step() -> Any:
        ctx = replica_context()
        return await ctx.all_reduce(op, values[ctx.replica_id_in_sync_group])

    result = await strategy.run(step)
    mine = [np.asarray(r).tobytes() for r in each_replica(strategy, result)]
    everyone = allgather(mine)
    assert everyone[0][0] == everyone[0][1] == everyone[1][0] == everyone[1][1]


async def test_weights_stay_bitwise_identical_after_many_steps(
    make_strategy: MakeStrategy,
) -> None:
    """Float32 weights trained 30 steps by SGD with gradients of very different magnitudes on
    each replica: the copies on both workers stay bitwise identical."""
    strategy = make_strategy()
    with strategy.scope():
        w = Variable(np.zeros(64, np.float32), name="w")
    optimizer = SGD(0.1)
    rng = np.random.default_rng(3)
    grads = rng.normal(size=(30, 4, 64)) * np.array([1e3, 1e-4, -1e3, 1.0])[None, :, None]
    grads = grads.astype(np.float32)

    for k in range(30):

        async def step(k: int = k) -> None:
            ctx = replica_context()
            await optimizer.apply_gradients([(grads[k, ctx.replica_id_in_sync_group], w)])

        await strategy.run(step)
    copies = [np.asarray(c).tobytes() for c in w.values]
    everyone = allgather(copies)
    assert everyone[0][0] == everyone[0][1] == everyone[1][0] == everyone[1][1]


# -- 28. large (threaded) collectives of another shape, and uneven large gathers -------------


@pytest.mark.timeout(60)
async def test_a_large_all_reduce_of_another_length_on_one_worker(
    make_strategy: MakeStrategy,
) -> None:
    """40 MiB on worker 0, 40 MiB and one element more on worker 1 (a padded embedding): both
    raise a ValueError naming both shapes, before any data moves on the threaded path."""
    strategy = make_strategy()
    size = 5 * 2**20 + RANK

    async def step() -> Any:
        total = await replica_context().all_reduce("sum", np.ones(size))
        return float(total[0])

    with anyio.move_on_after(30) as scope:
        mine = await outcome(lambda: strategy.run(step))
    outcomes = allgather((mine[0], mine[1][:2000], mine[2], scope.cancelled_caught))
    for rank, (kind, message, _seconds, timed_out) in enumerate(outcomes):
        assert not timed_out, f"rank {rank} still waiting after 30 s: {outcomes}"
        assert kind in ("ValueError", "WorkersDisagree"), outcomes
        assert str(5 * 2**20) in message, outcomes
        assert str(5 * 2**20 + 1) in message, outcomes
    await assert_in_step(strategy)


@pytest.mark.timeout(60)
async def test_large_uneven_all_gather_and_broadcast(make_strategy: MakeStrategy) -> None:
    """A 40 MiB all_gather whose rows differ per replica (worker 1's last replica has none),
    and a 40 MiB broadcast from worker 1 where worker 0 passes a small array: the results are
    NumPy's concatenation and the source's array, on every worker."""
    strategy = make_strategy()
    width = 2**10
    rows = [1300, 1200, 2600, 0]

    def block(replica: int) -> Any:
        return np.full((rows[replica], width), float(replica + 1))

    async def step() -> Any:
        ctx = replica_context()
        gathered = await ctx.all_gather(block(ctx.replica_id_in_sync_group), axis=0)
        source = np.arange(5 * 2**20, dtype=np.float64) if RANK == 1 else np.zeros(3)
        sent = await ctx.broadcast(source, source_replica=2)
        return (
            gathered.shape,
            float(gathered.sum()),
            float(gathered[1300, 0]),
            sent.shape,
            float(sent[-1]),
        )

    result = await strategy.run(step)
    expected = (
        (sum(rows), width),
        float(sum(r * (k + 1) for k, r in enumerate(rows)) * width),
        2.0,
        (5 * 2**20,),
        float(5 * 2**20 - 1),
    )
    everyone = allgather(each_replica(strategy, result))
    for rank in range(2):
        assert everyone[rank] == [expected, expected], everyone[rank]


# -- 29. drop_remainder set otherwise on one worker (a config read locally) -------------------


async def test_drop_remainder_set_otherwise_on_one_worker(make_strategy: MakeStrategy) -> None:
    """40 rows in batches of 16: worker 0 drops the last partial batch (drop_remainder=True),
    worker 1 keeps it. No hang: both make the same 3 steps, with the same totals."""
    strategy = make_strategy()
    data = np.arange(40.0).reshape(40, 1)
    batches = [data[i : i + 16] for i in range(0, 40, 16)]

    async def step(batch: Any) -> Any:
        return await replica_context().all_reduce("sum", float(np.sum(batch)))

    async def program() -> Any:
        totals = []
        dataset = strategy.distribute_dataset(batches, drop_remainder=RANK == 0)
        async for batch in dataset:
            result = await strategy.run(step, (batch,))
            totals.append(float(each_replica(strategy, result)[0]))
        return totals

    with anyio.move_on_after(15) as scope:
        mine = await outcome(program)
    outcomes = allgather((*mine, scope.cancelled_caught))
    for rank, (_kind, _message, _seconds, timed_out) in enumerate(outcomes):
        assert not timed_out, f"rank {rank} still waiting after 15 s: {outcomes}"
    # As documented ("a worker with one batch fewer ... end the pass together"; the
    # one-batch-short test of test_mw_dataset.py): both make 3 steps, and the last one sees
    # only worker 1's half of the partial batch (rows 36-39), worker 0's replicas none.
    assert [o[:2] for o in outcomes] == [("ok", "[120.0, 376.0, 150.0]")] * 2, outcomes


# -- 30. prefetch set otherwise on one worker ------------------------------------------------


@pytest.mark.parametrize("prefetch", [(0, 3), (3, 0), (1, 2)])
async def test_prefetch_set_otherwise_on_each_worker(
    make_strategy: MakeStrategy, prefetch: tuple[int, int]
) -> None:
    """Prefetch depth is a local tuning knob: worker 0 and 1 set it differently. The pass still
    gives every step the whole global batch's total, on both workers."""
    strategy = make_strategy()
    data = np.arange(96.0).reshape(96, 1)
    batches = [data[i : i + 16] for i in range(0, 96, 16)]

    async def step(batch: Any) -> Any:
        return await replica_context().all_reduce("sum", float(np.sum(batch)))

    totals = []
    with anyio.fail_after(15):
        async for batch in strategy.distribute_dataset(batches, prefetch=prefetch[RANK]):
            result = await strategy.run(step, (batch,))
            totals.append(float(each_replica(strategy, result)[0]))
    everyone = allgather(totals)
    assert everyone[0] == everyone[1] == [float(b.sum()) for b in batches], everyone


# -- 31. a partial restore on one worker, a full one on the other ------------------------------


async def test_partial_restore_on_one_worker_only(make_strategy: MakeStrategy) -> None:
    """Worker 1 restores with ``partial=True`` (its checkpoint object lacks the optimizer),
    worker 0 the full file: both raise, or both restore the chief's value; the weights are the
    same on both workers in any case."""
    strategy = make_strategy()
    with strategy.scope():
        w = Variable(np.zeros(2), name="w")
        b = Variable(np.zeros(2), name="b")
    with shared_directory() as path:
        await w.assign(np.full(2, 1.0))
        await b.assign(np.full(2, 1.0))
        saved = await Checkpoint(w=w, b=b).save(f"{path}/c")
        await w.assign(np.full(2, 2.0))
        await b.assign(np.full(2, 2.0))
        checkpoint = Checkpoint(w=w, b=b) if RANK == 0 else Checkpoint(w=w)
        with anyio.move_on_after(15) as scope:
            mine = await outcome(lambda: checkpoint.restore(saved, partial=RANK == 1))
        outcomes = allgather((mine[0], mine[1][:300], scope.cancelled_caught))
    for rank, (_kind, _message, timed_out) in enumerate(outcomes):
        assert not timed_out, f"rank {rank} still waiting after 15 s: {outcomes}"
    values = allgather(
        ([np.asarray(c).tolist() for c in w.values], [np.asarray(c).tolist() for c in b.values])
    )
    assert values[0] == values[1], (values, outcomes)


# -- 32. one more global batch on one worker, in a distribute_dataset pass --------------------


async def test_one_more_global_batch_on_one_worker(make_strategy: MakeStrategy) -> None:
    """``distribute_dataset`` over the same global batches, but worker 1's list has one more
    (a file appended between the workers' reads). No hang: both make the same 3 steps, the
    last with worker 1's half of the batch only (the documented one-batch-short case)."""
    strategy = make_strategy()
    data = np.arange(48.0).reshape(48, 1)
    batches = [data[i : i + 16] for i in range(0, 48, 16)][: 2 + RANK]

    async def step(batch: Any) -> Any:
        return await replica_context().all_reduce("sum", float(np.sum(batch)))

    async def program() -> Any:
        totals = []
        async for batch in strategy.distribute_dataset(batches):
            result = await strategy.run(step, (batch,))
            totals.append(float(each_replica(strategy, result)[0]))
        return totals

    with anyio.move_on_after(15) as scope:
        mine = await outcome(program)
    outcomes = allgather((*mine, scope.cancelled_caught))
    for rank, (_kind, _message, _seconds, timed_out) in enumerate(outcomes):
        assert not timed_out, f"rank {rank} still waiting after 15 s: {outcomes}"
    # As documented for a worker one batch short: the third step sees only worker 1's half of
    # batch 3 (rows 40-47: 348 of its 632), worker 0's replicas get zero rows.
    assert [o[:2] for o in outcomes] == [("ok", "[120.0, 376.0, 348.0]")] * 2, outcomes


# -- an exception inside a blocking cross-worker read, between its waits -------------------------


class Boom(Exception):
    """What the proxied communicator raises where a read posts its reduction."""


class _FailingPost:
    """The strategy's communicator, whose ``Iallreduce`` raises ``Boom`` (an MPI error, or a
    signal handler's exception, where the read posts its reduction)."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm

    def Iallreduce(self, *args: Any, **kwargs: Any) -> Any:
        raise Boom("posting failed")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)


async def test_an_exception_between_the_waits_of_a_blocking_read_fails_the_worker(
    make_strategy: MakeStrategy,
) -> None:
    """Worker 1's blocking read of a sync-on-read variable raises between its waits (its
    records exchanged, its reduction not posted): worker 1 raises that exception and counts
    as failed, so worker 0, waiting in the read's reduction, raises a ReplicaSyncError naming
    it within seconds instead of waiting out its sync_timeout; worker 1's next call is
    refused."""
    strategy = make_strategy(1, sync_timeout=8.0)
    with strategy.scope():
        v = Variable(1.0, synchronization="on_read", aggregation="sum", name="s")
    assert float(v.numpy()) == 2.0  # synced, and read once on every worker
    workers = strategy._workers  # the communicator a read posts on
    real = workers._comm
    if RANK == 1:
        workers._comm = _FailingPost(real)

    async def read() -> float:
        return float(v.numpy())

    try:
        got = await outcome(read)
    finally:
        workers._comm = real
    seen = allgather(got)
    assert seen[1][:2] == ("Boom", "posting failed"), seen
    assert seen[0][0] == "ReplicaSyncError", seen
    assert seen[0][1].startswith(
        "worker 1 failed: its reading sync-on-read variable #0 's' (float64 ()) was interrupted "
        "by Boom"
    ), seen
    assert seen[0][2] < 4, seen
    after = allgather(await outcome(read))
    assert after[1][0] == "ClusterBroken", after
