"""What a worker reports of its replicas (``statistics()``, trace files, ``trace-summary``)
names them by their ids in sync, as ``replica_id_in_sync_group`` does."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from aioreplica._cli import format_trace_summary, summarize_trace
from aioreplica.testing import replica_context
from multiworker.mwtools import RANK, WORKERS, global_ids

if TYPE_CHECKING:
    from pathlib import Path

    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

#: Seconds the last replica of the last worker is late to the merge point.
LATE = 0.2


async def test_statistics_and_traces_use_ids_in_sync(
    make_strategy: MakeStrategy, tmp_path: Path
) -> None:
    """The last worker's second replica is late to an all_reduce. On each worker the
    statistics and the trace put its own replicas at their ids in sync (worker 1's are 2 and
    3), and the late one is the slowest replica of its worker."""
    strategy = make_strategy(2)
    mine = global_ids(2)
    late = global_ids(2, WORKERS - 1)[-1]

    async def step() -> float:
        ctx = replica_context()
        if ctx.replica_id_in_sync_group == late:
            await anyio.sleep(LATE)
        result: float = await ctx.all_reduce("sum", 1.0)
        return result

    async with strategy.trace(tmp_path / "run.json") as path:
        await strategy.run(step)

    stats = strategy.statistics()
    assert len(stats.wait_total) == len(stats.wait_max) == 2 * WORKERS
    assert stats.slowest_replica in mine
    others = [i for i in range(2 * WORKERS) if i not in mine]
    assert [stats.wait_total[i] for i in others] == [0.0] * len(others)
    if late in mine:
        (waiting,) = [i for i in mine if i != late]
        assert stats.slowest_replica == late
        assert stats.wait_total[late] == 0.0
        assert stats.wait_total[waiting] >= LATE / 2
        assert stats.wait_max[waiting] == stats.wait_total[waiting]

    document: dict[str, Any] = json.loads(await anyio.Path(path).read_text())
    names = {
        event["tid"]: event["args"]["name"]
        for event in document["traceEvents"]
        if event["ph"] == "M" and event["name"] == "thread_name"
    }
    assert names == {replica: f"replica {replica}" for replica in mine}
    computed = {
        (event["tid"], event["args"]["replica"])
        for event in document["traceEvents"]
        if event["ph"] == "X" and event["name"] == "compute"
    }
    assert computed == {(replica, replica) for replica in mine}
    summary = format_trace_summary(summarize_trace(path))
    rows = [line.split()[:2] for line in summary.splitlines()[2:] if line.startswith(" ")]
    assert rows == [[str(RANK), str(replica)] for replica in mine], summary
    if late in mine:
        assert f"arrived last most often: replica {late} (worker {RANK})" in summary, summary
