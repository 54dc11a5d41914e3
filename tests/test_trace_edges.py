"""Traces at their edges: paths that name no file, a file that cannot be written at the end,
and a run already in progress when tracing starts."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import aioreplica
from aioreplica import MirroredStrategy, _trace
from aioreplica.testing import host_devices

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(path) as file:
        document: dict[str, Any] = json.load(file)
    return document


@pytest.mark.parametrize(
    ("path", "error", "message"),
    [
        ("", FileNotFoundError, r"^the trace path is empty; name a JSON file"),
        ("newdir/", IsADirectoryError, r"^the trace path 'newdir/' ends with a separator, so it "),
        ("a.json/", IsADirectoryError, r"names a folder; name a file \(a\.json/run\.json, say\)$"),
    ],
)
async def test_a_path_that_names_no_file_is_refused_at_the_start(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    error: type[OSError],
    message: str,
) -> None:
    """The empty path and a path ending with a separator could never be written: refused when
    the trace starts (by both forms), not lost when it stops; nothing is left behind."""
    monkeypatch.chdir(tmp_path)
    strategy = MirroredStrategy(host_devices(2))
    with pytest.raises(error, match=message):
        strategy.start_trace(path)
    assert _trace.recorder is None
    with pytest.raises(error, match=message):
        async with strategy.trace(path):
            pytest.fail("the block must not run")
    assert _trace.recorder is None
    assert os.listdir(tmp_path) == []


async def test_a_file_that_cannot_be_written_names_the_trace_not_a_temporary_file(
    tmp_path: Path,
) -> None:
    """The folder of the trace went away while it was recorded: stopping it says which trace
    was not written, and names no temporary file."""
    folder = tmp_path / "gone"
    folder.mkdir()
    target = folder / "run.json"
    strategy = MirroredStrategy(host_devices(2))
    strategy.start_trace(target)
    await strategy.run(lambda: None)
    folder.rmdir()
    with pytest.raises(FileNotFoundError) as caught:
        strategy.stop_trace()
    assert str(caught.value) == (
        f"the trace was not written to {str(target)!r}: No such file or directory; it is lost "
        "(check that its folder still exists and the disk has room)"
    )
    assert ".tmp" not in str(caught.value)
    assert _trace.recorder is None


async def test_a_run_in_progress_when_tracing_starts_is_not_traced(tmp_path: Path) -> None:
    """A run that started before the trace records nothing in it, neither on its replicas'
    tracks nor on the track of the task that started the trace; a run that starts while it
    is recorded is traced."""
    strategy = MirroredStrategy(host_devices(2))
    started = anyio.Event()
    traced = anyio.Event()

    async def before() -> None:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        started.set()
        await traced.wait()
        await ctx.all_reduce("sum", 1.0)
        await ctx.device.run(float, 1)

    async def during() -> float:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        result: float = await ctx.all_reduce("max", 2.0)
        return result

    path = tmp_path / "run.json"
    async with anyio.create_task_group() as group:
        group.start_soon(strategy.run, before)
        await started.wait()
        async with strategy.trace(path):
            traced.set()
            await anyio.sleep(0.05)  # the run begun before goes on, and ends
            await strategy.run(during)
    document = load(path)
    names = {
        event["tid"]: event["args"]["name"]
        for event in document["traceEvents"]
        if event["ph"] == "M" and event["name"] == "thread_name"
    }
    recorded = sorted(
        (names[event["tid"]], event["name"], event["args"].get("op", ""))
        for event in document["traceEvents"]
        if event["ph"] == "X"
    )
    # Only the run begun within the trace: its all_reduce, on the replica that merged it.
    others = [entry for entry in recorded if entry[1] not in ("compute", "merge wait")]
    merged_on = others[0][0] if others else ""
    assert others == [
        (merged_on, "all_reduce", "max"),
        (merged_on, "merge_fn _merge_all_reduce", ""),
    ]
    assert sorted(names.values()) == ["replica 0", "replica 1"]


async def test_the_blocks_exception_survives_a_trace_that_cannot_be_written(
    tmp_path: Path,
) -> None:
    """The block raises, and then its trace cannot be written: the block's exception comes
    out, with a note naming the trace that was lost; no trace stays active."""
    folder = tmp_path / "gone"
    folder.mkdir()
    target = folder / "run.json"
    strategy = MirroredStrategy(host_devices(2))

    async def step() -> None:
        raise ValueError("the training step failed")

    async def traced() -> None:
        async with strategy.trace(target):
            folder.rmdir()
            await strategy.run(step)

    with pytest.raises(ValueError, match=r"^the training step failed") as caught:
        await traced()
    assert caught.value.__notes__[-1] == (
        f"while it was raised, the trace was not written to {str(target)!r}: No such file or "
        "directory; it is lost (check that its folder still exists and the disk has room)"
    )
    assert _trace.recorder is None
