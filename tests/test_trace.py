"""Timeline traces: ``strategy.trace(path)``, ``start_trace`` / ``stop_trace`` and the file."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from example_modules import EXAMPLES, load_example

import aioreplica
from aioreplica import MirroredStrategy, _trace
from aioreplica.testing import host_devices, replica_id

pytestmark = pytest.mark.anyio

#: Rounding: times are written in microseconds with three decimals.
EPSILON = 0.002


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(path) as file:
        document: dict[str, Any] = json.load(file)
    return document


def spans(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [event for event in document["traceEvents"] if event["ph"] == "X"]


def track_names(document: dict[str, Any]) -> dict[int, str]:
    return {
        event["tid"]: event["args"]["name"]
        for event in document["traceEvents"]
        if event["ph"] == "M" and event["name"] == "thread_name"
    }


def tid_of(document: dict[str, Any], name: str) -> int:
    (tid,) = [tid for tid, named in track_names(document).items() if named == name]
    return tid


def end(span: dict[str, Any]) -> float:
    return float(span["ts"] + span["dur"])


def inside(child: dict[str, Any], parent: dict[str, Any]) -> bool:
    return bool(parent["ts"] - EPSILON <= child["ts"] and end(child) <= end(parent) + EPSILON)


def check_nesting(document: dict[str, Any]) -> dict[int, list[tuple[int, dict[str, Any]]]]:
    """Assert that the spans of every track nest; return each track's spans with their depth,
    in order."""
    by_track: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for span in spans(document):
        assert span["dur"] >= 0, span
        by_track[span["pid"], span["tid"]].append(span)
    depths: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for (_, tid), track in by_track.items():
        track.sort(key=lambda span: (span["ts"], -span["dur"]))
        open_spans: list[dict[str, Any]] = []
        depths[tid] = []
        for span in track:
            while open_spans and span["ts"] >= end(open_spans[-1]) - EPSILON:
                if inside(span, open_spans[-1]) and span["dur"] <= EPSILON:
                    break  # an instant at the very end of its parent
                open_spans.pop()
            if open_spans:
                assert inside(span, open_spans[-1]), (
                    f"on track {tid}, {span} overlaps {open_spans[-1]} without nesting in it"
                )
            depths[tid].append((len(open_spans), span))
            open_spans.append(span)
    return depths


def top_level(depths: list[tuple[int, dict[str, Any]]]) -> list[str]:
    return [span["name"] for depth, span in depths if depth == 0]


def parent_of(
    span: dict[str, Any], depths: list[tuple[int, dict[str, Any]]]
) -> dict[str, Any] | None:
    """The innermost span of the same track that holds ``span``."""
    holders = [
        other
        for _, other in depths
        if other is not span and inside(span, other) and other["dur"] >= span["dur"]
    ]
    return min(holders, key=lambda other: other["dur"], default=None)


def merge_twice(strategy: Any, value: Any) -> Any:
    return value


async def test_the_spans_of_a_step_are_named_and_nest(tmp_path: Path) -> None:
    """A step with device.run, a merge_call, a collective and a barrier, fed by a distributed
    dataset, between a checkpoint save and a restore: every span is where it belongs."""
    strategy = MirroredStrategy(host_devices(2))
    with strategy.scope():
        weights = aioreplica.Variable(np.zeros(3))
    checkpoint = aioreplica.Checkpoint(weights=weights)
    dataset = strategy.distribute_dataset(aioreplica.batched(np.arange(8.0), 4), prefetch=2)

    def square_sum(x: Any) -> float:
        return float((x * x).sum())

    async def step(x: Any) -> Any:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        local = await ctx.device.run(square_sum, x)
        merged = await ctx.merge_call(merge_twice, args=(local,))
        total = await ctx.all_reduce("sum", np.full(3, local))
        await ctx.barrier()
        return merged, total

    path = tmp_path / "run.json"
    async with strategy.trace(path) as written:
        assert written == str(path)
        await checkpoint.save(tmp_path / "ckpt.npz")
        async for batch in dataset:
            await strategy.run(step, args=(batch,))
        await checkpoint.restore(tmp_path / "ckpt.npz")
    document = load(path)

    assert document["displayTimeUnit"] == "ms"
    assert document["otherData"] == {
        "aioreplica": aioreplica.__version__,
        "replicas": 2,
        "worker": 0,
    }
    metadata = [event for event in document["traceEvents"] if event["ph"] == "M"]
    assert metadata[0] == {
        "ph": "M",
        "name": "process_name",
        "pid": 0,
        "args": {"name": "worker 0"},
    }
    names = track_names(document)
    assert names[0] == "replica 0"
    assert names[1] == "replica 1"
    assert sorted(names.values()) == ["main", "prefetch", "replica 0", "replica 1"]
    assert {tid for tid, name in names.items() if name in ("main", "prefetch")} == {2, 3}

    depths = check_nesting(document)
    steps = 2  # two global batches of 4 rows
    for replica in (0, 1):
        track = depths[replica]
        # compute, merge wait (merge_call), compute, merge wait (all_reduce), compute,
        # merge wait (barrier), compute: per step.
        assert top_level(track) == (["compute", "merge wait"] * 3 + ["compute"]) * steps
        runs = [span for depth, span in track if span["name"] == "device.run square_sum"]
        assert len(runs) == steps
        for span in runs:
            holder = parent_of(span, track)
            assert holder is not None
            assert holder["name"] == "compute"
            assert span["args"] == {"device": f"cpu:{replica}"}
        waits = [span for _, span in track if span["name"] == "merge wait"]
        assert [span["args"]["round"] for span in waits] == list(range(1, 3 * steps + 1))
        assert [span["args"]["merge"] for span in waits] == [1, 2, 3] * steps
        assert all(span["args"]["replica"] == replica for span in waits)

    # Each round's merge function ran on the track of the replica that arrived last, inside
    # that replica's wait.
    waits_by_round: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    for replica in (0, 1):
        for _, span in depths[replica]:
            if span["name"] == "merge wait":
                waits_by_round[span["args"]["round"]][replica] = span
    merge_names: Counter[str] = Counter()
    for replica in (0, 1):
        for _, span in depths[replica]:
            if span["name"].startswith("merge_fn "):
                merge_names[span["name"]] += 1
                number = span["args"]["merge"]
                holder = parent_of(span, depths[replica])
                assert holder is not None
                assert holder["name"] == "merge wait"
                assert holder["args"]["merge"] == number
                arrivals = waits_by_round[holder["args"]["round"]]
                last = max(arrivals, key=lambda r: arrivals[r]["ts"])
                assert last == replica
    assert merge_names == {
        "merge_fn merge_twice": steps,
        "merge_fn _merge_all_reduce": steps,
        "merge_fn _merge_barrier": steps,
    }

    collectives = [
        (replica, span)
        for replica in (0, 1)
        for _, span in depths[replica]
        if span["name"] in ("all_reduce", "barrier")
    ]
    assert Counter(span["name"] for _, span in collectives) == {"all_reduce": 2, "barrier": 2}
    for replica, span in collectives:
        holder = parent_of(span, depths[replica])
        assert holder is not None
        if span["name"] == "all_reduce":
            assert holder["name"] == "merge_fn _merge_all_reduce"
            assert span["args"] == {"op": "sum", "bytes": 24, "devices": 2}
        else:
            assert holder["name"] == "merge_fn _merge_barrier"
            assert span["args"] == {"devices": 2}

    main = depths[tid_of(document, "main")]
    assert [span["name"] for _, span in main] == ["checkpoint save", "checkpoint restore"]
    assert [span["args"] for _, span in main] == [{"path": str(tmp_path / "ckpt.npz")}] * 2
    prefetch = depths[tid_of(document, "prefetch")]
    # Two batches, and the pull that finds the end.
    assert [span["name"] for _, span in prefetch] == ["dataset prefetch"] * 3
    assert all(span["args"] == {"ahead": 2} for _, span in prefetch)


async def test_a_trace_of_two_runs(tmp_path: Path) -> None:
    """The merge rounds of a trace count on across runs; the second run comes after the first."""
    strategy = MirroredStrategy(host_devices(3))

    async def step() -> None:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        await ctx.merge_call(merge_twice, args=(1,))
        await ctx.merge_call(merge_twice, args=(2,))

    strategy.start_trace(tmp_path / "two.json")
    await strategy.run(step)
    await strategy.run(step)
    assert strategy.stop_trace() == str(tmp_path / "two.json")
    document = load(tmp_path / "two.json")
    depths = check_nesting(document)
    assert sorted(depths) == [0, 1, 2]  # no other track: nothing ran outside the replicas
    for replica in range(3):
        track = depths[replica]
        assert top_level(track) == ["compute", "merge wait", "compute", "merge wait", "compute"] * 2
        waits = [span for _, span in track if span["name"] == "merge wait"]
        assert [span["args"]["round"] for span in waits] == [1, 2, 3, 4]
        assert [span["args"]["merge"] for span in waits] == [1, 2, 1, 2]
        computes = [span for _, span in track if span["name"] == "compute"]
        assert end(computes[2]) <= computes[3]["ts"] + EPSILON  # run 2 starts after run 1
    rounds = Counter(
        span["args"]["round"] for span in spans(document) if span["name"] == "merge wait"
    )
    assert rounds == {1: 3, 2: 3, 3: 3, 4: 3}


async def test_a_plain_step_function_is_one_compute_span(tmp_path: Path) -> None:
    strategy = MirroredStrategy(host_devices(2))
    async with strategy.trace(tmp_path / "plain.json"):
        assert await strategy.run(lambda: 7) == 7
    depths = check_nesting(load(tmp_path / "plain.json"))
    assert {tid: top_level(track) for tid, track in depths.items()} == {
        0: ["compute"],
        1: ["compute"],
    }


async def test_tasks_a_replica_starts_record_on_tracks_of_their_own(tmp_path: Path) -> None:
    """Two device jobs awaited at once by tasks of one replica overlap: they cannot both nest
    on the replica's track, so one goes on ``replica r (2)``."""
    strategy = MirroredStrategy(host_devices(1))

    def job() -> None:
        return None

    async def step() -> None:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        async with anyio.create_task_group() as group:
            for _ in range(2):
                group.start_soon(ctx.device.run, job)
        await ctx.merge_call(merge_twice, args=(0,))

    async with strategy.trace(tmp_path / "tasks.json"):
        await strategy.run(step)
    document = load(tmp_path / "tasks.json")
    depths = check_nesting(document)
    names = track_names(document)
    jobs = [
        (names[tid], span["name"])
        for tid, track in depths.items()
        for _, span in track
        if span["name"].startswith("device.run")
    ]
    assert sorted(jobs) == [("replica 0", "device.run job"), ("replica 0 (2)", "device.run job")]
    assert top_level(depths[0]) == ["compute", "merge wait", "compute"]


async def test_concurrent_runs_take_tracks_of_their_own(tmp_path: Path) -> None:
    strategy = MirroredStrategy(host_devices(2))
    both_started = anyio.Event()
    started: list[int] = []

    async def step(tag: int) -> int:
        if replica_id() == 0:
            started.append(tag)
            if len(started) == 2:
                both_started.set()
        await both_started.wait()
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        return int(await ctx.all_reduce("sum", tag))

    results: dict[int, Any] = {}

    async def one(tag: int) -> None:
        results[tag] = await strategy.run(step, args=(tag,))

    async with strategy.trace(tmp_path / "concurrent.json"), anyio.create_task_group() as group:
        group.start_soon(one, 1)
        group.start_soon(one, 2)
    assert results == {1: 2, 2: 4}
    document = load(tmp_path / "concurrent.json")
    depths = check_nesting(document)
    names = track_names(document)
    assert sorted(names.values()) == ["replica 0", "replica 0 (2)", "replica 1", "replica 1 (2)"]
    for tid, track in depths.items():
        assert top_level(track) == ["compute", "merge wait", "compute"], names[tid]
        assert all(
            span["args"]["replica"] == int(names[tid].split()[1])
            for _, span in track
            if span["name"] in ("compute", "merge wait")
        )


async def test_another_strategy_is_not_recorded(tmp_path: Path) -> None:
    traced = MirroredStrategy(host_devices(2))
    other = MirroredStrategy(host_devices(2))

    async def step() -> None:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        await ctx.device.run(float, 1)
        await ctx.all_reduce("sum", 1.0)

    async with traced.trace(tmp_path / "one.json"):
        await other.run(step)
        await traced.run(step)
    document = load(tmp_path / "one.json")
    depths = check_nesting(document)
    assert sorted(track_names(document).values()) == ["replica 0", "replica 1"]
    assert sum(1 for span in spans(document) if span["name"] == "all_reduce") == 1
    assert sum(1 for span in spans(document) if span["name"] == "device.run float") == 2
    assert all(
        top_level(track) == ["compute", "merge wait", "compute"] for track in depths.values()
    )


async def test_the_file_is_written_once_complete_and_atomically(tmp_path: Path) -> None:
    """Nothing is written while tracing; at the end the whole file replaces the old one at
    once, and no temporary file is left."""
    path = tmp_path / "run.json"
    path.write_text("an older trace")
    strategy = MirroredStrategy(host_devices(2))
    async with strategy.trace(path):
        await strategy.run(lambda: None)
        assert path.read_text() == "an older trace"
    assert sorted(os.listdir(tmp_path)) == ["run.json"]
    check_nesting(load(path))
    assert _trace.recorder is None


async def test_the_file_is_written_when_the_block_fails_or_is_cancelled(tmp_path: Path) -> None:
    strategy = MirroredStrategy(host_devices(2))
    with pytest.raises(ZeroDivisionError):
        async with strategy.trace(tmp_path / "failed.json"):
            await strategy.run(lambda: 1 / 0)
    assert sorted(track_names(load(tmp_path / "failed.json")).values()) == [
        "replica 0",
        "replica 1",
    ]
    with anyio.CancelScope() as scope:
        async with strategy.trace(tmp_path / "cancelled.json"):
            await strategy.run(lambda: None)
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    check_nesting(load(tmp_path / "cancelled.json"))
    assert _trace.recorder is None


async def test_a_file_that_cannot_be_written_raises_and_ends_the_trace(tmp_path: Path) -> None:
    folder = tmp_path / "gone"
    folder.mkdir()
    strategy = MirroredStrategy(host_devices(1))
    strategy.start_trace(folder / "run.json")
    folder.rmdir()
    with pytest.raises(FileNotFoundError):
        strategy.stop_trace()
    assert _trace.recorder is None
    strategy.start_trace(tmp_path / "again.json")  # a new trace can start
    strategy.stop_trace()
    assert load(tmp_path / "again.json")["otherData"]["replicas"] == 1


async def test_a_folder_that_cannot_be_written_is_refused_at_the_start(tmp_path: Path) -> None:
    """A trace that could not be written is refused when it starts, not lost when it stops:
    no trace is active after the refusal, and nothing is left in the folder."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):  # root writes anywhere; /proc refuses new files
            if sys.platform != "linux":
                pytest.skip("no folder here that refuses a new file")
            folder = Path("/proc")
        strategy = MirroredStrategy(host_devices(1))
        with pytest.raises(OSError, match=r"^cannot write the trace file .*run\.json.* here: "):
            strategy.start_trace(folder / "run.json")
        with pytest.raises(OSError, match=r"^cannot write the trace file"):
            async with strategy.trace(folder / "run.json"):
                pytest.fail("the block must not run")
        assert _trace.recorder is None
        assert not any(name.endswith(".tmp") for name in os.listdir(folder))
    finally:
        (tmp_path / "read-only").chmod(0o755)


async def test_start_and_stop_refuse_what_they_cannot_do(tmp_path: Path) -> None:
    strategy = MirroredStrategy(host_devices(2))
    other = MirroredStrategy(host_devices(1))
    with pytest.raises(RuntimeError, match=r"^no trace is being recorded by MirroredStrategy"):
        strategy.stop_trace()
    strategy.start_trace(str(tmp_path / "first.json"))
    try:
        with pytest.raises(RuntimeError, match=r"already being recorded .*first\.json"):
            strategy.start_trace(tmp_path / "second.json")
        with pytest.raises(RuntimeError, match=r"already being recorded"):
            other.start_trace(tmp_path / "second.json")
        with pytest.raises(RuntimeError, match=r"already being recorded"):
            async with other.trace(tmp_path / "second.json"):
                pytest.fail("the block must not run")
        with pytest.raises(RuntimeError, match=r"stop it through the strategy that started it"):
            other.stop_trace()
    finally:
        strategy.stop_trace()
    assert not (tmp_path / "second.json").exists()
    with pytest.raises(TypeError, match=r"str or os\.PathLike, got int 3"):
        strategy.start_trace(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must be text, not bytes"):
        strategy.start_trace(_Bytes())  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match=r"does not exist; create it first"):
        strategy.start_trace(tmp_path / "missing" / "run.json")
    with pytest.raises(IsADirectoryError, match=r"is a folder"):
        strategy.start_trace(tmp_path)
    assert _trace.recorder is None


async def test_closing_a_strategy_stops_and_writes_its_trace(tmp_path: Path) -> None:
    """close() and aclose() end the strategy's trace and write its file; closing a strategy
    that is not the one traced leaves the trace recording."""
    events: list[object] = []
    for how in ("close", "aclose"):
        strategy = MirroredStrategy(host_devices(2))
        bystander = MirroredStrategy(host_devices(1))
        strategy.start_trace(tmp_path / f"{how}.json")
        await strategy.run(lambda: 1)
        await bystander.aclose()
        events.append((how, "bystander closed", _trace.recorder is not None))
        if how == "close":
            strategy.close()
        else:
            await strategy.aclose()
        events.append((how, "recording", _trace.recorder is not None))
        names = {span["name"] for span in spans(load(tmp_path / f"{how}.json"))}
        events.append((how, "compute spans", "compute" in names))
    assert events == [
        ("close", "bystander closed", True),
        ("close", "recording", False),
        ("close", "compute spans", True),
        ("aclose", "bystander closed", True),
        ("aclose", "recording", False),
        ("aclose", "compute spans", True),
    ]
    with pytest.raises(RuntimeError, match=r"^no trace is being recorded by MirroredStrategy"):
        strategy.stop_trace()


async def test_a_collected_strategys_trace_blocks_no_other(tmp_path: Path) -> None:
    """A strategy dropped while its trace records (a failed test, say) takes the trace with
    it once collected, unwritten: another strategy's trace can then start."""
    dropped = MirroredStrategy(host_devices(2))
    dropped.start_trace(tmp_path / "dropped.json")
    await dropped.run(lambda: 1)
    gone = weakref.ref(dropped)
    del dropped
    # Strategies are in reference cycles, and a worker thread lets go of its last job a
    # moment after the job's result reached the loop: collect until it is gone, within a bound.
    with anyio.fail_after(5):
        while gone() is not None:
            gc.collect()
            await anyio.sleep(0.01)
    assert _trace.recorder is None
    other = MirroredStrategy(host_devices(1))
    other.start_trace(tmp_path / "other.json")
    await other.run(lambda: 1)
    assert os.path.basename(other.stop_trace()) == "other.json"
    assert sorted(os.listdir(tmp_path)) == ["other.json"]


class _Bytes(os.PathLike[bytes]):
    def __fspath__(self) -> bytes:
        return b"run.json"


class _SecondWorker(MirroredStrategy):
    def _worker_index(self) -> int:
        return 1


async def test_a_worker_other_than_the_first_adds_its_index_to_the_name(tmp_path: Path) -> None:
    strategy = _SecondWorker(host_devices(2))
    async with strategy.trace(tmp_path / "run.json") as written:
        await strategy.run(lambda: None)
    assert written == str(tmp_path / "run.worker1.json")
    assert not (tmp_path / "run.json").exists()
    document = load(written)
    assert document["otherData"]["worker"] == 1
    assert {event["pid"] for event in document["traceEvents"]} == {1}
    assert document["traceEvents"][0]["args"] == {"name": "worker 1"}


def check_training_trace(document: dict[str, Any], replicas: int) -> None:
    names = track_names(document)
    replica_tracks = sorted(tid for tid, name in names.items() if name.startswith("replica"))
    assert [names[tid] for tid in replica_tracks] == [f"replica {r}" for r in range(replicas)]
    assert replica_tracks == list(range(replicas))
    depths = check_nesting(document)
    for replica in range(replicas):
        kinds = {span["name"] for _, span in depths[replica]}
        assert {"compute", "merge wait", "device.run loss_and_grads"} <= kinds
    # The optimizer's merge function, and its all-reduce, ran on some replica's track.
    merged = {span["name"] for tid in range(replicas) for _, span in depths[tid]}
    assert {"merge_fn Optimizer._merge_apply", "all_reduce"} <= merged


async def test_train_digits_writes_a_trace(tmp_path: Path) -> None:
    digits = load_example("train_digits")
    path = tmp_path / "run.json"
    result = await digits.main(
        3, max_steps=4, progress=False, trace=str(path), checkpoint_dir=str(tmp_path / "c")
    )
    assert result.steps == 4
    check_training_trace(load(path), 3)


@pytest.mark.timeout(120)
def test_train_digits_traces_from_the_command_line(tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "train_digits.py"),
            "--replicas",
            "2",
            "--epochs",
            "1",
            "--checkpoint-dir",
            str(tmp_path / "checkpoints"),
            "--trace",
            str(tmp_path / "run.json"),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert str(tmp_path / "run.json") in completed.stdout
    check_training_trace(load(tmp_path / "run.json"), 2)
