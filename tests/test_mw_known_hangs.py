"""Known hangs of Horovod / DDP / TF MWMS that kill a rank or end the job, replayed as MPI jobs.

Each scenario is a small script (written to ``tmp_path``) run under ``mpiexec -n 2``; each rank
prints ``rank R: KIND: MESSAGE (SECONDS s)`` for what its step ended with. The test asserts
that the job ended within seconds (no hang) and what the surviving rank saw.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
from mpi_jobs import Job, mpiexec, run_job

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ["asyncio", "trio"]

PRELUDE = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import anyio
    import numpy as np
    from mpi4py import MPI
    from aioreplica import MultiWorkerMirroredStrategy
    from aioreplica.testing import host_devices, replica_context

    RANK = MPI.COMM_WORLD.Get_rank()
    BACKEND = sys.argv[1]

    def say(kind, message, start):
        print(f"rank {RANK}: {kind}: {message} ({time.monotonic() - start:.1f} s)", flush=True)

    async def attempt(call):
        start = time.monotonic()
        try:
            result = await call()
        except Exception as exc:
            say(type(exc).__name__, str(exc).replace(chr(10), " "), start)
        else:
            say("ok", repr(result), start)
    """
)

SCRIPTS = {
    # A rank calls sys.exit(3) inside its replica, mid-step (a "fatal data error" path).
    "exit-in-replica": """
    async def main():
        strategy = MultiWorkerMirroredStrategy(host_devices(2))
        async def step():
            ctx = replica_context()
            if RANK == 1 and ctx.replica_id_in_sync_group == 3:
                sys.exit(3)
            return await ctx.all_reduce("sum", 1.0)
        await attempt(lambda: strategy.run(step))
        await attempt(lambda: strategy.run(step))
    anyio.run(main, backend=BACKEND)
    """,
    # The same with sys.exit(0): a clean exit status from a rank that left mid-step.
    "exit0-in-replica": """
    async def main():
        strategy = MultiWorkerMirroredStrategy(host_devices(2))
        async def step():
            ctx = replica_context()
            if RANK == 1 and ctx.replica_id_in_sync_group == 3:
                sys.exit(0)
            return await ctx.all_reduce("sum", 1.0)
        await attempt(lambda: strategy.run(step))
    anyio.run(main, backend=BACKEND)
    """,
    # A rank dies hard (os._exit, as an OOM kill would) mid-step: no exit notice is sent.
    "hard-exit": """
    async def main():
        strategy = MultiWorkerMirroredStrategy(host_devices(2))
        async def step():
            ctx = replica_context()
            if RANK == 1:
                os._exit(9)
            return await ctx.all_reduce("sum", 1.0)
        await attempt(lambda: strategy.run(step))
    anyio.run(main, backend=BACKEND)
    """,
    # Ctrl-C (SIGINT) reaches rank 1 while it waits in an all_reduce that rank 0 reaches 3 s
    # later; rank 1's program catches the KeyboardInterrupt and ends normally.
    "sigint-in-collective": """
    async def main():
        strategy = MultiWorkerMirroredStrategy(host_devices(2))
        async def step():
            ctx = replica_context()
            if RANK == 0:
                await anyio.sleep(3)
            return await ctx.all_reduce("sum", 1.0)
        if RANK == 1:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        await attempt(lambda: strategy.run(step))
    try:
        anyio.run(main, backend=BACKEND)
    except KeyboardInterrupt:
        print(f"rank {RANK}: KeyboardInterrupt", flush=True)
    """,
    # Rank 1's program dies of an uncaught exception *after* its last collective, while rank 0
    # goes on to a strategy.reduce; plain python, no -m mpi4py.
    "uncaught-after-last": """
    async def main():
        strategy = MultiWorkerMirroredStrategy(host_devices(2))
        async def step():
            return await replica_context().all_reduce("sum", 1.0)
        await strategy.run(step)
        if RANK == 1:
            raise ValueError("checkpoint upload failed on worker 1")
        await attempt(lambda: strategy.reduce("sum", np.float64(1.0), axis=None))
    anyio.run(main, backend=BACKEND)
    """,
    # Rank 1 blocks in synchronous code with no sync_timeout for 4 s, then raises uncaught:
    # rank 0 waits in the all_reduce; the job must end once rank 1 dies.
    "blocked-then-dies": """
    async def main():
        strategy = MultiWorkerMirroredStrategy(host_devices(2))
        async def step():
            ctx = replica_context()
            if RANK == 1 and ctx.replica_id_in_sync_group == 3:
                time.sleep(2)  # noqa: ASYNC251 (blocking on purpose)
                raise MemoryError("host out of memory on worker 1")
            return await ctx.all_reduce("sum", 1.0)
        await attempt(lambda: strategy.run(step))
    anyio.run(main, backend=BACKEND)
    """,
    # Rank 1 trains one step inside `async with strategy:` (which closes it) and its program
    # ends; rank 0 then reduces a metric on its still-open strategy.
    "closed-then-left": """
    async def main():
        strategy = MultiWorkerMirroredStrategy(host_devices(2))
        async def step():
            return await replica_context().all_reduce("sum", 1.0)
        if RANK == 1:
            async with strategy:
                await strategy.run(step)
            return
        await strategy.run(step)
        await attempt(lambda: strategy.reduce("sum", np.float64(1.0), axis=None))
    anyio.run(main, backend=BACKEND)
    """,
    # Rank 1 leaves the dataset pass early and its program ends; rank 0 goes on with the pass.
    "left-during-pass": """
    async def main():
        strategy = MultiWorkerMirroredStrategy(host_devices(2))
        async def step(batch):
            return await replica_context().all_reduce("sum", float(np.sum(batch)))
        batches = [np.ones((4, 1)) * (k + 1) for k in range(6)]
        async def loop():
            steps = 0
            async for batch in strategy.distribute_dataset(batches):
                await strategy.run(step, (batch,))
                steps += 1
                if RANK == 1 and steps == 2:
                    return "left"
            return steps
        await attempt(loop)
    anyio.run(main, backend=BACKEND)
    """,
    # Rank 1 drops its strategy (a new model's strategy replaces it) and then idles 30 s in
    # other work; rank 0 reduces on the old one with sync_timeout=2.
    "dropped-then-idle": """
    import gc
    async def main():
        strategy = MultiWorkerMirroredStrategy(host_devices(2), sync_timeout=2)
        async def step():
            return await replica_context().all_reduce("sum", 1.0)
        await strategy.run(step)
        if RANK == 1:
            del strategy
            gc.collect()
            await anyio.sleep(8)
            print("rank 1: idled", flush=True)
            return
        await attempt(lambda: strategy.reduce("sum", np.float64(1.0), axis=None))
    anyio.run(main, backend=BACKEND)
    """,
    # Ctrl-C reaches rank 1 while it waits in a *blocking* collective (a new variable's first
    # read, outside any run()); rank 0 reaches its read 5 s later.
    "sigint-in-blocking-read": """
    from aioreplica import Variable
    async def main():
        strategy = MultiWorkerMirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.full(2, float(RANK + 1)), name="w")
        if RANK == 0:
            await anyio.sleep(5)
        else:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            value = w.numpy()
        except KeyboardInterrupt:
            say("KeyboardInterrupt", "in w.numpy()", start)
        except Exception as exc:
            say(type(exc).__name__, str(exc).replace(chr(10), " "), start)
        else:
            say("ok", f"read {value.tolist()}", start)
        # The program goes on (it caught Ctrl-C to save its state, say): a reduce.
        async def reduce():
            return await strategy.reduce("sum", np.float64(1.0), axis=None)
        start = time.monotonic()
        try:
            got = await reduce()
        except Exception as exc:
            print(f"again {RANK}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        else:
            print(f"again {RANK}: ok {got!r}", flush=True)
    anyio.run(main, backend=BACKEND)
    """,
    # As sigint-in-collective, but the program catches the KeyboardInterrupt and goes on to a
    # reduce (to save its state, say).
    "sigint-in-collective-goes-on": """
    async def main():
        strategy = MultiWorkerMirroredStrategy(host_devices(2))
        async def step():
            ctx = replica_context()
            if RANK == 0:
                await anyio.sleep(3)
            return await ctx.all_reduce("sum", 1.0)
        if RANK == 1:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            await attempt(lambda: strategy.run(step))
        except KeyboardInterrupt:
            say("KeyboardInterrupt", "in run()", start)
        try:
            got = await strategy.reduce("sum", np.float64(1.0), axis=None)
        except Exception as exc:
            print(f"again {RANK}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        else:
            print(f"again {RANK}: ok {got!r}", flush=True)
    anyio.run(main, backend=BACKEND)
    """,
    # A preemption handler (SIGTERM -> SystemExit, as on Kubernetes) fires on rank 1 while it
    # waits in a blocking read of a sync-on-read metric; the program catches it to checkpoint.
    "sigterm-in-blocking-read": """
    from aioreplica import Variable, VariableAggregation, VariableSynchronization
    class Preempted(Exception):
        pass
    def on_term(signum, frame):
        raise Preempted("SIGTERM: preempted")
    signal.signal(signal.SIGTERM, on_term)
    async def main():
        strategy = MultiWorkerMirroredStrategy(host_devices(2))
        with strategy.scope():
            m = Variable(0.0, name="m", synchronization=VariableSynchronization.ON_READ,
                         aggregation=VariableAggregation.SUM)
        m.numpy()  # synced: the read below is a plain aggregation
        if RANK == 0:
            await anyio.sleep(5)
        else:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        start = time.monotonic()
        try:
            value = m.numpy()
        except Preempted:
            say("Preempted", "in m.numpy()", start)
        except Exception as exc:
            say(type(exc).__name__, str(exc).replace(chr(10), " "), start)
        else:
            say("ok", f"read {value!r}", start)
        try:
            got = await strategy.reduce("sum", np.float64(1.0), axis=None)
        except Exception as exc:
            print(f"again {RANK}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        else:
            print(f"again {RANK}: ok {got!r}", flush=True)
    anyio.run(main, backend=BACKEND)
    """,
}


def launch(tmp_path: Path, name: str, backend: str, *, mpi4py: bool = True) -> Job:
    script = tmp_path / f"{name}.py"
    script.write_text(PRELUDE + textwrap.dedent(SCRIPTS[name]))
    command = [
        *mpiexec(2),
        sys.executable,
        *(["-m", "mpi4py"] if mpi4py else []),
        str(script),
        backend,
    ]
    return run_job(command, timeout=45, cwd=ROOT, merge_output=True)


def line(job: Job, rank: int) -> str:
    """Rank ``rank``'s first report line (the ranks' lines may interleave mid-line)."""
    found = re.search(rf"rank {rank}: .*?\(\d+\.\d s\)|rank {rank}: \w+$", job.output, re.M)
    return found.group(0) if found else ""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sys_exit_in_a_replica_fails_the_other_worker(tmp_path: Path, backend: str) -> None:
    """Rank 1's replica calls ``sys.exit(3)`` mid-step. Rank 0's run() raises a
    ReplicaSyncError naming worker 1 within seconds; the job ends non-zero, in seconds."""
    job = launch(tmp_path, "exit-in-replica", backend)
    assert job.seconds < 20, job.log
    assert job.returncode != 0, job.log
    assert line(job, 0).startswith("rank 0: ReplicaSyncError"), job.log
    assert "worker 1" in line(job, 0), job.log


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sys_exit_0_in_a_replica_fails_the_other_worker(tmp_path: Path, backend: str) -> None:
    """Rank 1's replica calls ``sys.exit(0)`` mid-step. Rank 0 must not hang, nor report a
    successful step: it raises a ReplicaSyncError naming worker 1, in seconds."""
    job = launch(tmp_path, "exit0-in-replica", backend)
    assert job.seconds < 20, job.log
    assert line(job, 0).startswith("rank 0: ReplicaSyncError"), job.log
    assert "worker 1" in line(job, 0), job.log


@pytest.mark.timeout(60)
def test_a_rank_killed_mid_step_ends_the_job(tmp_path: Path) -> None:
    """Rank 1 dies at once (``os._exit(9)``, as an OOM kill): no notice reaches rank 0, but the
    job still ends non-zero within seconds (the launcher ends it), never a hang."""
    job = launch(tmp_path, "hard-exit", "asyncio")
    assert job.seconds < 20, job.log
    assert job.returncode != 0, job.log


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ctrl_c_in_a_waiting_rank_fails_the_other(tmp_path: Path, backend: str) -> None:
    """SIGINT reaches rank 1 while it waits in an all_reduce that rank 0 reaches 3 s later.
    Rank 1 ends with KeyboardInterrupt; rank 0's run() then raises a ReplicaSyncError naming
    worker 1, rather than completing the collective or waiting forever."""
    job = launch(tmp_path, "sigint-in-collective", backend)
    assert job.seconds < 20, job.log
    assert "rank 1: KeyboardInterrupt" in job.output, job.log
    assert line(job, 0).startswith("rank 0: ReplicaSyncError"), job.log
    assert "worker 1" in line(job, 0), job.log


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_uncaught_error_after_the_last_collective_ends_the_job(
    tmp_path: Path, backend: str
) -> None:
    """Without ``-m mpi4py``: rank 1 dies of an uncaught error after its last step while rank 0
    reduces. The job ends non-zero within seconds, rank 1's error printed; whatever rank 0
    printed is no success."""
    job = launch(tmp_path, "uncaught-after-last", backend, mpi4py=False)
    assert job.seconds < 20, job.log
    assert job.returncode != 0, job.log
    assert "checkpoint upload failed on worker 1" in job.output, job.log
    assert not line(job, 0).startswith("rank 0: ok"), job.log


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_blocked_rank_that_then_dies_fails_the_other(tmp_path: Path, backend: str) -> None:
    """Rank 1 blocks its loop for 2 s then its replica raises MemoryError (caught by the
    script's attempt); rank 0, waiting in the all_reduce with no sync_timeout, raises a
    ReplicaSyncError naming worker 1 and the MemoryError within seconds."""
    job = launch(tmp_path, "blocked-then-dies", backend)
    assert job.seconds < 20, job.log
    assert line(job, 0).startswith("rank 0: ReplicaSyncError"), job.log
    assert "MemoryError" in line(job, 0), job.log
    assert line(job, 1).startswith("rank 1: MemoryError"), job.log


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_worker_that_closed_and_left_fails_the_others_reduce(
    tmp_path: Path, backend: str
) -> None:
    """Rank 1 closes its strategy (``async with``) and its program ends; rank 0's reduce on its
    own strategy must raise (ReplicaSyncError naming worker 1, or its own closed error) in
    seconds, never wait forever for a worker that has left."""
    job = launch(tmp_path, "closed-then-left", backend)
    assert job.seconds < 20, job.log
    assert line(job, 0), job.log
    assert not line(job, 0).startswith("rank 0: ok"), job.log


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_worker_that_left_a_pass_and_ended_fails_the_other(tmp_path: Path, backend: str) -> None:
    """Rank 1 returns from its loop after 2 steps and its program ends; rank 0, going on with
    the pass, raises a ReplicaSyncError naming worker 1 in seconds."""
    job = launch(tmp_path, "left-during-pass", backend)
    assert job.seconds < 20, job.log
    assert line(job, 0).startswith("rank 0: ReplicaSyncError"), job.log
    assert "worker 1" in line(job, 0), job.log


@pytest.mark.timeout(60)
def test_a_dropped_strategy_with_sync_timeout(tmp_path: Path) -> None:
    """Rank 1 drops its strategy and idles; rank 0 reduces under sync_timeout=2: rank 0 raises a
    ReplicaSyncError naming worker 1 within a few seconds, while rank 1 still idles."""
    job = launch(tmp_path, "dropped-then-idle", "asyncio")
    assert job.seconds < 25, job.log
    assert line(job, 0).startswith("rank 0: ReplicaSyncError"), job.log
    assert "worker 1" in line(job, 0), job.log
    seconds = float(line(job, 0).rsplit("(", 1)[1].split()[0])
    assert seconds < 5, job.log


@pytest.mark.timeout(60)
def test_ctrl_c_in_a_blocking_read_ends_the_wait(tmp_path: Path) -> None:
    """trio: SIGINT reaches rank 1 while it waits in a new variable's blocking first read;
    rank 0 reads 5 s later. Rank 1's read ends with KeyboardInterrupt within about a second;
    the program catches it and goes on to a reduce. The interrupted read counts as rank 1
    failing (as a cancelled call does): rank 1's reduce raises ClusterBroken, rank 0's a
    ReplicaSyncError naming worker 1; no MPI internals (a persistent request left active)
    leak out as the reason."""
    job = launch(tmp_path, "sigint-in-blocking-read", "trio")
    assert job.seconds < 20, job.log
    assert line(job, 1).startswith("rank 1: KeyboardInterrupt"), job.log
    seconds = float(line(job, 1).rsplit("(", 1)[1].split()[0])
    assert seconds < 2, job.log
    assert "again 1: ClusterBroken" in job.output, job.log
    assert "again 0: ReplicaSyncError" in job.output, job.log
    assert "Invalid MPI_Request" not in job.output, job.log


@pytest.mark.timeout(60)
def test_ctrl_c_in_a_collective_then_going_on(tmp_path: Path) -> None:
    """trio: SIGINT reaches rank 1 in a run()'s all_reduce that rank 0 reaches 3 s later; the
    program catches the KeyboardInterrupt and reduces. Rank 1's reduce raises ClusterBroken,
    rank 0's run() (or reduce) a ReplicaSyncError naming worker 1; no MPI internals leak."""
    job = launch(tmp_path, "sigint-in-collective-goes-on", "trio")
    assert job.seconds < 20, job.log
    assert line(job, 1).startswith("rank 1: KeyboardInterrupt"), job.log
    assert "again 1: ClusterBroken" in job.output, job.log
    assert line(job, 0).startswith("rank 0: ReplicaSyncError"), job.log
    assert "Invalid MPI_Request" not in job.output, job.log


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_preemption_signal_in_a_blocking_read(tmp_path: Path, backend: str) -> None:
    """A SIGTERM handler raising an exception (a preemption notice) fires on rank 1 in a
    blocking read of a sync-on-read metric; rank 0 reads 5 s later. The program catches it
    and reduces. The interrupted read counts as rank 1 failing: its reduce raises
    ClusterBroken, rank 0's read or reduce a ReplicaSyncError naming worker 1; no MPI
    internals leak out."""
    job = launch(tmp_path, "sigterm-in-blocking-read", backend)
    assert job.seconds < 20, job.log
    assert line(job, 1).startswith("rank 1: Preempted"), job.log
    assert "again 1: ClusterBroken" in job.output, job.log
    assert "again 0: ok" not in job.output, job.log
    assert "Invalid MPI_Request" not in job.output, job.log
