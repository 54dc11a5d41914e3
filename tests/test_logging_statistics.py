"""The ``aioreplica`` logger, the slow merge warning, and ``strategy.statistics()``."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from log_records import Records, recorded

import aioreplica
from aioreplica import MirroredStrategy
from aioreplica._scheduler import _WATCHDOG, _Watchdog
from aioreplica.testing import host_devices, replica_id

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

#: Seconds before a slow merge point is logged, in these tests: short, and still far longer
#: than a merge round of replicas that are not held up.
THRESHOLD = 0.05
#: Seconds any one wait of these tests may take before it counts as a hang.
PATIENCE = 10.0


def noop(strategy: Any) -> None:
    return None


@pytest.fixture
def records() -> Iterator[Records]:
    with recorded() as handler:
        yield handler


@pytest.fixture
def watched() -> Iterator[Callable[..., MirroredStrategy]]:
    """Makes strategies with a short ``slow_merge_warning``; closes them afterwards, so that
    the watchdog goes back to its usual pace (or ends)."""
    made: list[MirroredStrategy] = []

    def make(replicas: int, seconds: float | None = THRESHOLD) -> MirroredStrategy:
        strategy = MirroredStrategy(host_devices(replicas), slow_merge_warning=seconds)
        made.append(strategy)
        return strategy

    yield make
    for strategy in made:
        strategy.close()


# -- the logger -----------------------------------------------------------------------------


def test_the_logger_prints_nothing_unless_logging_is_configured() -> None:
    """A ``NullHandler`` on ``aioreplica``: Python's last-resort handler, which would print a
    warning to stderr, stays out of it; once logging is configured, the record shows."""
    assert any(
        isinstance(handler, logging.NullHandler)
        for handler in logging.getLogger("aioreplica").handlers
    )
    program = (
        "import logging, sys, aioreplica\n"
        "logging.getLogger('aioreplica').warning('quiet')\n"
        "if sys.argv[1] == 'configured':\n"
        "    logging.basicConfig()\n"
        "    logging.getLogger('aioreplica').warning('heard')\n"
    )
    for mode, expected in (("bare", ""), ("configured", "WARNING:aioreplica:heard\n")):
        completed = subprocess.run(
            [sys.executable, "-c", program, mode],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert (completed.stdout, completed.stderr) == ("", expected)


# -- the slow merge warning -----------------------------------------------------------------


@pytest.mark.anyio
async def test_a_slow_merge_point_is_logged_once_while_it_waits(
    records: Records, watched: Callable[..., MirroredStrategy]
) -> None:
    strategy = watched(3)
    go = anyio.Event()
    events: list[str] = []

    async def step() -> int:
        if replica_id() == 2:
            await go.wait()
        return int(await aioreplica.get_replica_context().all_reduce("sum", 1))  # type: ignore[union-attr]

    async def run() -> None:
        result = await strategy.run(step)
        events.append(f"run returned {result}")

    with anyio.fail_after(PATIENCE):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            assert await anyio.to_thread.run_sync(records.first.wait, PATIENCE)
            events.append(f"logged while {strategy.statistics().replicas_waiting} waited")
            # Two more looks at the same merge point: still one warning.
            assert await anyio.to_thread.run_sync(_WATCHDOG.wait_passes, 2, PATIENCE)
            events.append(f"{len(records.warnings())} warning after two more looks")
            go.set()
    assert events == ["logged while 2 waited", "1 warning after two more looks", "run returned 3"]

    (record,) = records.warnings()
    assert record.name == "aioreplica"
    message = record.getMessage()
    assert message.startswith("all_reduce (merge_call #1) of a run() on MirroredStrategy(")
    assert "of a run() on MirroredStrategy(devices=['cpu:0', 'cpu:1', 'cpu:2'])" in message
    assert "for replica 2, which has not arrived (replicas 0 and 1 waiting)" in message
    assert "(slow_merge_warning=0.05 s: logged once per merge point)" in message
    assert record.merge_number == 1  # type: ignore[attr-defined]
    assert record.late_replicas == [2]  # type: ignore[attr-defined]
    assert record.waiting_replicas == [0, 1]  # type: ignore[attr-defined]
    assert record.waited >= THRESHOLD  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_each_slow_merge_point_is_logged(
    records: Records, watched: Callable[..., MirroredStrategy]
) -> None:
    """A second slow merge point of the same run gets its own warning, naming its replicas."""
    strategy = watched(2)
    gates = [anyio.Event(), anyio.Event()]

    async def step() -> None:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        for number, late in enumerate((1, 0)):
            if replica_id() == late:
                await gates[number].wait()
            await ctx.merge_call(noop)

    with anyio.fail_after(PATIENCE):
        async with anyio.create_task_group() as group:
            group.start_soon(strategy.run, step)
            for number in range(2):
                while len(records.warnings()) <= number:  # logged by the watchdog thread
                    await anyio.to_thread.run_sync(_WATCHDOG.wait_passes, 1, PATIENCE)
                gates[number].set()
    late = [(r.merge_number, r.late_replicas) for r in records.warnings()]  # type: ignore[attr-defined]
    assert late == [(1, [1]), (2, [0])]


@pytest.mark.anyio
async def test_none_disables_the_warning(
    records: Records, watched: Callable[..., MirroredStrategy]
) -> None:
    """A strategy with ``slow_merge_warning=None`` is not watched: while the watchdog looks
    (for another strategy), its slow merge point is not logged."""
    quiet = watched(2, None)
    assert quiet.slow_merge_warning is None
    assert watched(1).slow_merge_warning == THRESHOLD  # keeps the watchdog looking often
    go = anyio.Event()

    async def step() -> None:
        if replica_id() == 1:
            await go.wait()
        await aioreplica.get_replica_context().barrier()  # type: ignore[union-attr]

    with anyio.fail_after(PATIENCE):
        async with anyio.create_task_group() as group:
            group.start_soon(quiet.run, step)
            await anyio.wait_all_tasks_blocked()
            waited_from = quiet.statistics()
            assert waited_from.replicas_waiting == 1
            await anyio.sleep(THRESHOLD)  # the merge point has waited past the threshold
            assert await anyio.to_thread.run_sync(_WATCHDOG.wait_passes, 2, PATIENCE)
            go.set()
    assert records.warnings() == []


def test_the_default_is_a_minute() -> None:
    assert MirroredStrategy(host_devices(1)).slow_merge_warning == 60.0


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf])
def test_slow_merge_warning_must_be_positive_and_finite(bad: float) -> None:
    with pytest.raises(ValueError, match=r"^slow_merge_warning must be a positive, finite number"):
        MirroredStrategy(host_devices(1), slow_merge_warning=bad)


@pytest.mark.parametrize("bad", ["60", True, [1.0]])
def test_slow_merge_warning_must_be_a_number(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"^slow_merge_warning must be a number of seconds or None"):
        MirroredStrategy(host_devices(1), slow_merge_warning=bad)


def test_the_watchdog_thread_ends_when_nothing_is_watched() -> None:
    """One thread for every watched scheduler; it ends once none is left, and starts again."""
    watchdog = _Watchdog()
    scheduler = MirroredStrategy(host_devices(1), slow_merge_warning=None)._scheduler
    scheduler.slow_merge_warning = THRESHOLD
    watchdog.watch(scheduler)
    thread = watchdog.thread
    assert thread is not None
    assert thread.name == "aioreplica watchdog"
    assert thread.daemon
    assert watchdog.wait_passes(1, PATIENCE)
    watchdog.unwatch(scheduler)
    thread.join(PATIENCE)
    assert not thread.is_alive()
    assert watchdog.thread is None
    watchdog.watch(scheduler)
    again = watchdog.thread
    assert again is not None
    assert again is not thread
    watchdog.unwatch(scheduler)
    again.join(PATIENCE)
    assert not again.is_alive()


# -- statistics ------------------------------------------------------------------------------


def test_statistics_before_any_run() -> None:
    stats = MirroredStrategy(host_devices(3)).statistics()
    assert stats == aioreplica.SchedulerStatistics(
        runs_active=0,
        replicas_waiting=0,
        merge_rounds_completed=0,
        steps=0,
        wait_total=(0.0, 0.0, 0.0),
        wait_max=(0.0, 0.0, 0.0),
        slowest_replica=None,
    )


LATE = 0.02  # seconds replica 1 is late at each merge point
#: What a round surely waited for a replica ``LATE`` late: the others may resume (and start to
#: be timed) a little after it began to sleep.
SURELY = LATE / 2


async def late_replica_one(rounds: int) -> None:
    """Replica 1 arrives last at each of ``rounds`` merge points, ``LATE`` seconds after the
    others (they arrive at once: no await before their merge calls)."""
    ctx = aioreplica.get_replica_context()
    assert ctx is not None
    for _ in range(rounds):
        if ctx.replica_id_in_sync_group == 1:
            await anyio.sleep(LATE)
        await ctx.merge_call(noop)


@pytest.mark.anyio
async def test_statistics_name_the_late_replica_and_the_waits() -> None:
    strategy = MirroredStrategy(host_devices(3))
    await strategy.run(late_replica_one, args=(2,))
    stats = strategy.statistics()
    assert (stats.steps, stats.merge_rounds_completed, stats.slowest_replica) == (1, 2, 1)
    assert stats.wait_total[1] == 0.0  # the last to arrive never waits
    assert stats.wait_max[1] == 0.0
    for replica in (0, 2):
        assert stats.wait_max[replica] >= SURELY
        assert stats.wait_total[replica] >= 2 * SURELY
        assert stats.wait_max[replica] <= stats.wait_total[replica]
        assert stats.wait_total[replica] <= 2 * stats.wait_max[replica]
    # A second run adds to them.
    await strategy.run(late_replica_one, args=(1,))
    again = strategy.statistics()
    assert (again.steps, again.merge_rounds_completed, again.slowest_replica) == (2, 3, 1)
    assert again.wait_total[0] >= stats.wait_total[0] + SURELY
    assert again.wait_total[1] == 0.0


@pytest.mark.anyio
async def test_a_replica_arriving_in_between_is_charged_the_rounds_wait() -> None:
    """Replica 0 arrives first, 1 after ``LATE``, 2 after ``3 * LATE``: the round waited
    about ``3 * LATE``, and both replicas that were not last are charged all of it."""
    strategy = MirroredStrategy(host_devices(3))

    async def step() -> None:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        delay = (0.0, LATE, 3 * LATE)[ctx.replica_id_in_sync_group]
        if delay:
            await anyio.sleep(delay)
        await ctx.merge_call(noop)

    await strategy.run(step)
    stats = strategy.statistics()
    assert stats.slowest_replica == 2
    assert stats.wait_total[0] >= 3 * LATE - SURELY
    assert stats.wait_total == (stats.wait_total[0], stats.wait_total[0], 0.0)
    assert stats.wait_max == stats.wait_total


@pytest.mark.anyio
async def test_a_failed_run_is_no_step_and_its_unfinished_round_no_wait() -> None:
    strategy = MirroredStrategy(host_devices(2))

    async def step() -> None:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        await ctx.merge_call(noop)  # completes
        if ctx.replica_id_in_sync_group == 1:
            raise KeyError("replica 1 fails")
        await ctx.merge_call(noop)  # replica 0 waits here, for nothing

    with pytest.raises(KeyError):
        await strategy.run(step)
    stats = strategy.statistics()
    assert (stats.steps, stats.merge_rounds_completed, stats.runs_active) == (0, 1, 0)
    # The round that completed counts (the loop decides who came first: trio starts tasks
    # in a random order); the one that never completed does not.
    assert stats.slowest_replica in (0, 1)
    assert stats.wait_total[stats.slowest_replica] == 0.0
    assert stats.wait_total == stats.wait_max
    await strategy.run(lambda: None)
    assert strategy.statistics().steps == 1


@pytest.mark.anyio
async def test_run_steps_is_one_step_and_plain_runs_have_no_slowest_replica() -> None:
    strategy = MirroredStrategy(host_devices(2))
    await strategy.run(lambda: None)
    stats = strategy.statistics()
    assert (stats.steps, stats.slowest_replica) == (1, None)  # no merge round yet

    async def elements() -> Any:
        for value in range(3):
            yield aioreplica.PerReplica([value, value])

    await strategy.run_steps(lambda x: x, elements(), 5)  # runs out after 3
    stats = strategy.statistics()
    assert stats.steps == 2
    assert stats.merge_rounds_completed == 4  # one per element, and the one finding the end


@pytest.mark.anyio
async def test_a_closed_strategy_is_not_watched() -> None:
    strategy = MirroredStrategy(host_devices(1), slow_merge_warning=THRESHOLD)
    scheduler = strategy._scheduler
    assert scheduler in _WATCHDOG._schedulers
    strategy.close()
    assert scheduler not in _WATCHDOG._schedulers
    async with strategy:  # reopened
        assert scheduler in _WATCHDOG._schedulers
    assert scheduler not in _WATCHDOG._schedulers
