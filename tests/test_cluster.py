"""The multi-worker machinery in one process (a job of one worker), for what needs no peer: the
collectives' queue, refusals, the failed state, the host-core share, and that one worker
behaves as ``MirroredStrategy`` does. Two workers: tests/multiworker, under mpiexec."""

from __future__ import annotations

import functools
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

import aioreplica
from aioreplica import _cluster
from aioreplica._backends import _numpy
from aioreplica.testing import replica_context

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

pytestmark = pytest.mark.timeout(60)


class TestTurn:
    """One communicator's first-come queue."""

    @pytest.mark.anyio
    async def test_waiters_take_the_turn_in_arrival_order(self) -> None:
        turn = _cluster._Turn()
        order: list[str] = []
        await turn.acquire()  # held by the "first" collective

        async def collective(name: str) -> None:
            await turn.acquire()
            order.append(name)
            await anyio.lowlevel.checkpoint()
            turn.release()

        async with anyio.create_task_group() as group:
            for name in ("a", "b", "c"):
                group.start_soon(collective, name)
                await anyio.wait_all_tasks_blocked()
            order.append("first done")
            turn.release()
        assert order == ["first done", "a", "b", "c"]
        assert not turn.busy

    @pytest.mark.anyio
    async def test_a_cancelled_waiter_leaves_the_queue(self) -> None:
        turn = _cluster._Turn()
        await turn.acquire()
        got: list[str] = []

        async def wait_for_turn(name: str) -> None:
            await turn.acquire()
            got.append(name)
            turn.release()

        async with anyio.create_task_group() as group:
            group.start_soon(wait_for_turn, "never")
            await anyio.wait_all_tasks_blocked()
            group.cancel_scope.cancel()  # cancelled while it waits for the turn
        async with anyio.create_task_group() as group:
            group.start_soon(wait_for_turn, "next")
            await anyio.wait_all_tasks_blocked()
            turn.release()
        assert got == ["next"]
        assert not turn.busy

    def test_take_now_only_when_free(self) -> None:
        turn = _cluster._Turn()
        assert turn.take_now() is True
        assert turn.take_now() is False
        turn.release()
        assert turn.take_now() is True


class TestOneWorker:
    """A job of one worker (no mpiexec): the strategy behaves as ``MirroredStrategy``."""

    def test_cluster_facts(self) -> None:
        strategy = aioreplica.MultiWorkerMirroredStrategy(["cpu:0", "cpu:1"])
        assert strategy.cluster == aioreplica.Cluster(worker_index=0, num_workers=1)
        assert strategy.cluster.is_chief
        assert strategy.num_replicas_in_sync == 2
        assert repr(strategy) == (
            "MultiWorkerMirroredStrategy(devices=['cpu:0', 'cpu:1'], worker 0 of 1)"
        )

    def test_cluster_resolver_answers_as_tfs(self) -> None:
        """TF's testClusterResolverProperty: the resolver is the cluster, with TF's
        ClusterResolver methods."""
        strategy = aioreplica.MultiWorkerMirroredStrategy(["cpu:0", "cpu:1"])
        resolver = strategy.cluster_resolver
        assert resolver is strategy.cluster
        assert (resolver.task_type, resolver.task_id) == ("worker", 0)
        assert resolver.cluster_spec() == {"worker": ["rank 0"]}
        assert resolver.master() == ""
        assert resolver.num_accelerators() == {}
        assert aioreplica.Cluster(1, 3, gpus=2).num_accelerators() == {"GPU": 2}
        assert aioreplica.Cluster(1, 3).cluster_spec() == {"worker": ["rank 0", "rank 1", "rank 2"]}

    @pytest.mark.parametrize(
        ("args", "error", "message"),
        [
            ((-1, 1), ValueError, "worker_index must be an int >= 0, got -1"),
            ((5, 2), ValueError, "worker_index 5 is not one of the 2 workers' indices, 0 to 1"),
            (("0", 2), TypeError, "worker_index must be an int >= 0, got str '0'"),
            ((0, 0), ValueError, "num_workers must be an int >= 1, got 0"),
            ((0, True), TypeError, "num_workers must be an int >= 1, got bool True"),
            ((0, 2, 1.5), TypeError, "gpus must be an int >= 0, got float 1.5"),
            ((0, 2, -1), ValueError, "gpus must be an int >= 0, got -1"),
        ],
    )
    def test_cluster_fields_are_checked(
        self, args: tuple[Any, ...], error: type[Exception], message: str
    ) -> None:
        """A Cluster's fields are counts and an index among them: anything else is refused
        (a wrong type with TypeError); NumPy's integers are taken as ints."""
        with pytest.raises(error) as info:
            aioreplica.Cluster(*args)
        assert str(info.value) == f"Cluster: {message}"
        cluster = aioreplica.Cluster(np.int64(1), np.int32(3), gpus=np.uint8(2))  # type: ignore[arg-type]
        assert cluster == aioreplica.Cluster(1, 3, 2)
        assert [type(n) for n in (cluster.worker_index, cluster.num_workers, cluster.gpus)] == [
            int,
            int,
            int,
        ]

    def test_master_refuses_a_task_not_in_the_cluster(self) -> None:
        """master(task_type, task_id) names a task of the cluster, as TF's ClusterSpec
        requires: another job or index is a ValueError, an index of another type a
        TypeError; one argument alone is ignored, as in TF."""
        cluster = aioreplica.Cluster(0, 2)
        refused = []
        for task_type, task_id in [("chief", 0), ("worker", 2), ("worker", -1), ("worker", "1")]:
            with pytest.raises((TypeError, ValueError)) as info:
                cluster.master(task_type, task_id)  # type: ignore[arg-type]
            refused.append((type(info.value), str(info.value)))
        assert refused == [
            (ValueError, "master(): no such job in the cluster: 'chief'; its one job is 'worker'"),
            (ValueError, "master(): no task with index 2 in job 'worker', whose tasks are 0 to 1"),
            (ValueError, "master(): no task with index -1 in job 'worker', whose tasks are 0 to 1"),
            (TypeError, "master(): task_id must be an int, got str '1'"),
        ]
        answers = [cluster.master("worker", 1), cluster.master("chief"), cluster.master(None, 5)]
        assert answers == ["", "", ""]

    def test_gpus_count_the_workers_gpu_replicas(self, cp: Any) -> None:
        strategy = aioreplica.MultiWorkerMirroredStrategy(["gpu:0", "gpu:1"])
        assert strategy.cluster_resolver.num_accelerators() == {"GPU": 2}

    @pytest.mark.anyio
    async def test_the_same_results_as_one_process(self) -> None:
        """Collectives, a dataset pass and a variable give what MirroredStrategy gives."""
        results = []
        for strategy in (
            aioreplica.MirroredStrategy(["cpu:0", "cpu:1"]),
            aioreplica.MultiWorkerMirroredStrategy(["cpu:0", "cpu:1"]),
        ):
            with strategy.scope():
                w = aioreplica.Variable(np.arange(3.0), name="w", aggregation="mean")

            async def step(batch: Any, w: Any = w) -> Any:
                ctx = replica_context()
                total = await ctx.all_reduce("mean", batch.sum(axis=0))
                gathered = await ctx.all_gather(batch)
                await w.assign_add(np.full(3, float(ctx.replica_id_in_sync_group)))
                return total, gathered

            batches = aioreplica.batched(np.arange(21.0).reshape(7, 3), 4)
            seen = [
                await strategy.run(step, (batch,))
                async for batch in strategy.distribute_dataset(batches)
            ]
            results.append((seen, w.numpy()))
        (one_seen, one_w), (multi_seen, multi_w) = results
        np.testing.assert_array_equal(one_w, multi_w)
        for a, b in zip(one_seen, multi_seen, strict=True):
            for x, y in zip(aioreplica.nest.flatten(a), aioreplica.nest.flatten(b), strict=True):
                np.testing.assert_array_equal(
                    np.asarray(aioreplica.select_replica(0, x)),
                    np.asarray(aioreplica.select_replica(0, y)),
                )

    def test_a_communicator_that_is_not_one(self) -> None:
        with pytest.raises(TypeError, match="communicator must be an mpi4py intracommunicator"):
            aioreplica.MultiWorkerMirroredStrategy(["cpu:0"], communicator="world")

    @pytest.mark.anyio
    async def test_a_global_length_argument_says_arguments_are_local(self) -> None:
        from mpi4py import MPI

        strategy = aioreplica.MultiWorkerMirroredStrategy(
            ["cpu:0", "cpu:1"], communicator=MPI.COMM_SELF
        )
        with pytest.raises(ValueError, match="run\\(\\) takes this worker's values"):
            await strategy.run(lambda x: x, (aioreplica.PerReplica([1, 2, 3]),))
        assert await strategy.run(lambda: 1) == 1  # refused alone: the strategy still works

    @pytest.mark.anyio
    async def test_a_concurrent_run_is_refused(self) -> None:
        strategy = aioreplica.MultiWorkerMirroredStrategy(["cpu:0"])
        started = anyio.Event()
        release = anyio.Event()
        refused: list[str] = []

        async def slow() -> int:
            started.set()
            await release.wait()
            return 1

        async with anyio.create_task_group() as group:
            group.start_soon(strategy.run, slow)
            await started.wait()
            with pytest.raises(RuntimeError, match="another run\\(\\) is in progress") as info:
                await strategy.run(lambda: 2)
            refused.append(str(info.value))
            release.set()
        assert len(refused) == 1
        assert await strategy.run(lambda: 3) == 3

    @pytest.mark.anyio
    async def test_after_a_failure_every_call_is_refused(self) -> None:
        strategy = aioreplica.MultiWorkerMirroredStrategy(["cpu:0", "cpu:1"])

        async def fails() -> None:
            if replica_context().replica_id_in_sync_group == 1:
                raise KeyError("bad row")
            await replica_context().barrier()

        with pytest.raises(KeyError, match="bad row"):
            await strategy.run(fails)
        with pytest.raises(RuntimeError, match="MPI cannot cancel a collective") as refused:
            await strategy.run(lambda: 1)
        assert "KeyError: 'bad row' was raised in replica 1" in str(refused.value)
        with pytest.raises(RuntimeError, match="MPI cannot cancel a collective"):
            await strategy.reduce("sum", aioreplica.PerReplica([1.0, 2.0]))

    @pytest.mark.anyio
    async def test_a_cancelled_run_counts_as_a_failure(self) -> None:
        strategy = aioreplica.MultiWorkerMirroredStrategy(["cpu:0"])
        with anyio.move_on_after(0.05):
            await strategy.run(anyio.sleep_forever)
        with pytest.raises(RuntimeError, match="its run\\(\\) was cancelled"):
            await strategy.run(lambda: 1)


def test_host_reductions_split_over_this_workers_share_of_the_cores() -> None:
    cores = _numpy._cores()
    try:
        _numpy.share_cores(2)
        assert _numpy._cores() == max(1, cores // 2)
        _numpy.share_cores(10_000)
        assert _numpy._cores() == 1
    finally:
        _numpy.share_cores(1)
    assert _numpy._cores() == cores


def test_without_mpi4py_the_error_says_what_to_install() -> None:
    """The ImportError names the extra to install (mpi4py hidden from a child interpreter)."""
    code = (
        "import sys; sys.modules['mpi4py'] = None\n"
        "import aioreplica\n"
        "try:\n"
        "    aioreplica.MultiWorkerMirroredStrategy(['cpu:0'])\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "pip install 'aioreplica[mpi]'" in out.stdout
    assert "mpiexec -n N" in out.stdout


@pytest.mark.parametrize("what", ["a receive under way", "a communicator being made"])
def test_a_communicator_given_back_unsettled_keeps_its_requests_and_buffers(what: str) -> None:
    """``_free`` keeps a communicator whose request may still complete, and that request
    with it: mpi4py lets go of a request's buffer when the request object goes, and MPI would
    later write the message (or the new communicator's handle) into memory given back."""
    mpi = _cluster.import_mpi()
    buffer = np.zeros(8, np.uint8)
    if what == "a receive under way":
        comm = mpi.COMM_SELF.Dup()
        request = comm.Recv_init(buffer, 0, 99)  # nobody sends it
        request.Start()
        _cluster._free(mpi, comm, persistent=[request])
    else:
        comm = mpi.COMM_SELF.Dup()
        request = comm.Irecv(buffer, 0, 98)  # stands in for an Idup that has not completed
        _cluster._free(mpi, comm, made=request)
    held = sys.getrefcount(buffer)
    kept = _cluster._kept[-1]
    del request
    assert sys.getrefcount(buffer) == held  # the kept request still holds the buffer
    assert kept[0] is comm
    _cluster._kept.remove(kept)
    for request in kept[1]:  # (this test's own: withdrawn, so that MPI can finalize)
        request.Cancel()
        request.Wait()
    comm.Free()


class _NeverCompletes:
    """A request that stays under way, as a collective does while a peer is late."""

    def Test(self) -> bool:  # mpi4py's name
        return False


@pytest.mark.anyio
async def test_a_wait_left_early_keeps_the_buffers_its_request_writes() -> None:
    """mpi4py's non-blocking collectives (``Iallreduce``, ``Iallgatherv``) do not hold their
    buffers: a wait left before its request completed (a dataset pass given up) keeps what
    posted it, with those buffers, for as long as it keeps the request; freed, MPI would
    write the peers' data into memory given back (a heap corrupted in later MPI calls)."""
    strategy = aioreplica.MultiWorkerMirroredStrategy(["cpu:0"])
    workers = strategy._workers.duplicate("a test's pass")
    await workers._await_idup()
    buffer = np.zeros(8)
    post = functools.partial(lambda out: _NeverCompletes(), buffer)
    with anyio.move_on_after(0.05) as scope:
        await workers._move(post, "a test's collective", buffer.nbytes)
    assert scope.cancelled_caught
    ((request, held),) = workers._left
    assert (type(request), held) == (_NeverCompletes, post)  # with the request, its buffers
    left = workers._left
    workers.close()
    _cluster._free_retired()  # the request may still complete: kept, with its buffer
    (kept,) = [kept for kept in _cluster._kept if kept[2] is left]
    _cluster._kept.remove(kept)
    assert kept[2] == [(request, post)]
    kept[0].Free()  # (this test's own: nothing can write into it)


@pytest.mark.anyio
async def test_a_synchronous_wait_left_early_keeps_what_holds_its_buffers() -> None:
    """The same for a synchronous read's wait (``blocking``): its request is kept with what
    the caller said holds its buffers when the wait ends before the request completes."""
    strategy = aioreplica.MultiWorkerMirroredStrategy(["cpu:0"])
    workers = strategy._workers
    buffer = np.zeros(8)
    with workers.timeout(0.05), pytest.raises(aioreplica.ReplicaSyncError):
        workers.blocking("a test's read", lambda comm, wait: wait(_NeverCompletes(), buffer))
    ((request, kept),) = workers._left
    assert type(request) is _NeverCompletes
    assert isinstance(kept, tuple)
    assert kept[1] is buffer  # (``post``, ``held``)


@pytest.mark.anyio
async def test_a_call_interrupted_while_waiting_is_announced_as_the_user_made_it() -> None:
    """A worker interrupted while waiting in a collective of a call tells its peers which call
    failed (``Checkpoint.save``) and where it waited (its ``broadcast``, unless in the call's
    own agreement), however the wait ended; outside any call it names the wait."""
    told: list[str] = []
    buffer = np.zeros(8)
    post = functools.partial(lambda out: _NeverCompletes(), buffer)

    async def in_call(workers: Any, call: str | None, what: str = "broadcast") -> None:
        with anyio.move_on_after(0.05):
            if call is None:
                await workers._move(post, what, buffer.nbytes)
            else:
                async with workers.call(call):
                    await workers._move(post, what, buffer.nbytes)

    def failing(comm: object, wait: object) -> None:
        raise RuntimeError("MPI failed")

    async def read(workers: Any, call: str | None) -> None:
        if call is None:
            workers.blocking("read of v", failing)
        else:
            async with workers.call(call):
                workers.blocking("read of v", failing)

    for call, what in (("Checkpoint.save", "broadcast"), (None, "broadcast"), ("save", "save")):
        workers = aioreplica.MultiWorkerMirroredStrategy(["cpu:0"])._workers
        await in_call(workers, call, what)
        told.append(str(workers._side.failure).replace("CancelledError", "Cancelled"))
    for call in ("Checkpoint.restore", None):
        workers = aioreplica.MultiWorkerMirroredStrategy(["cpu:0"])._workers
        with pytest.raises(RuntimeError, match="MPI failed"):
            await read(workers, call)
        told.append(str(workers._side.failure))
    assert told == [
        "worker 0 failed: its Checkpoint.save was interrupted by Cancelled in broadcast",
        "worker 0 failed: its wait in broadcast was interrupted by Cancelled",
        "worker 0 failed: its save was interrupted by Cancelled",  # (the call's own agreement)
        "worker 0 failed: its Checkpoint.restore was interrupted by RuntimeError in read of v",
        "worker 0 failed: its read of v was interrupted by RuntimeError",
    ]


@pytest.mark.anyio
async def test_a_call_refused_after_a_failure_is_named_as_the_user_made_it() -> None:
    """Once the workers fell out of step, each cross-worker call is refused with
    ``ClusterBroken`` naming the call made (``strategy.reduce``), not the collective inside it
    (its ``all_reduce``)."""
    strategy = aioreplica.MultiWorkerMirroredStrategy(["cpu:0", "cpu:1"])
    strategy._workers._side.failure = "worker 1 failed: ValueError: boom"
    value = np.ones(2)
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "strategy.reduce": lambda: strategy.reduce(aioreplica.ReduceOp.SUM, value, axis=None),
        "strategy.gather": lambda: strategy.gather(value, axis=0),
        "extended.reduce_to": lambda: strategy.extended.reduce_to(
            aioreplica.ReduceOp.SUM, value, value
        ),
        "extended.batch_reduce_to": lambda: strategy.extended.batch_reduce_to(
            aioreplica.ReduceOp.SUM, [(value, value)]
        ),
        "run()": lambda: strategy.run(lambda: 1),
    }
    refused: list[str] = []
    for call in calls.values():
        with pytest.raises(aioreplica.ClusterBroken) as info:
            await call()
        refused.append(str(info.value).split(" was refused: ")[0])
        assert "(worker 1 failed: ValueError: boom)" in str(info.value)
    assert refused == list(calls)


@pytest.mark.anyio
async def test_a_task_that_outlives_its_call_is_refused_under_its_own_name() -> None:
    """A task started in a call (into a task group outside it) that runs on once the call
    has ended is refused naming what it called, not the call that started it."""
    strategy = aioreplica.MultiWorkerMirroredStrategy(["cpu:0"])
    workers = strategy._workers
    go = anyio.Event()
    refused: list[str] = []

    async def later() -> None:
        await go.wait()
        with pytest.raises(aioreplica.ClusterBroken) as info:
            await strategy.run(lambda: 1)
        refused.append(str(info.value).split(" was refused: ")[0])

    async with anyio.create_task_group() as group:
        async with workers.call("Checkpoint.save"):
            group.start_soon(later)
        workers._side.failure = "worker 1 failed: ValueError: boom"
        go.set()
    assert refused == ["run()"]
