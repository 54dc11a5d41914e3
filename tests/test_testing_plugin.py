"""The pytest plugin ``aioreplica.testing``: its fixtures, markers, option, report and helpers.

Plugin behaviour is checked by running small test modules with ``pytester`` (in process, with
the plugins installed here: this one through its entry point, pytest-asyncio, anyio).
"""

from __future__ import annotations

import contextvars
import inspect
import json
import subprocess
import sys
import textwrap
import threading
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

import aioreplica
import aioreplica.testing
from aioreplica import MirroredStrategy
from aioreplica.testing import (
    DeviceLog,
    FakeDevice,
    RecordingDevice,
    StrategyFactory,
    host_devices,
    replica_context,
    replica_id,
)

if TYPE_CHECKING:
    from collections.abc import Callable

#: The inner runs' configuration: pytest-asyncio in strict mode, set explicitly as its users
#: do; hypothesis's plugin is off (it imports all of hypothesis at the end of every run).
INI = """
[pytest]
addopts = -p no:cacheprovider -p no:hypothesispytest --strict-markers
asyncio_mode = strict
asyncio_default_fixture_loop_scope = function
"""

REPLICAS_USAGE = (
    "@pytest.mark.replicas on test_it takes replica counts, such as replicas(1, 2, 4), got "
)
INTERLEAVINGS_USAGE = (
    "@pytest.mark.interleavings on test_it takes one number of seeds, such as "
    "interleavings(10), got "
)


def run_inner(pytester: pytest.Pytester, source: str, *args: str) -> pytest.RunResult:
    """Run ``source`` as a test module in a fresh directory, with ``-v`` ids."""
    pytester.makeini(INI)
    pytester.makepyfile(test_inner=source)
    return pytester.runpytest("-v", *args)


def passed_ids(result: pytest.RunResult) -> list[str]:
    """The ids (``test_x[...]``) of the inner run's passed tests, in the order they ran."""
    return [
        line.split("::", 1)[1].split(" ")[0]
        for line in result.outlines
        if line.startswith("test_inner.py::") and " PASSED" in line
    ]


class TestHostDevices:
    def test_names_in_replica_order(self) -> None:
        """host_devices(n) names cpu:0 .. cpu:n-1, what MirroredStrategy takes."""
        assert host_devices(1) == ["cpu:0"]
        assert host_devices(4) == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
        assert MirroredStrategy(host_devices(3)).devices == ("cpu:0", "cpu:1", "cpu:2")

    @pytest.mark.parametrize(
        ("n", "error", "message"),
        [
            (
                0,
                ValueError,
                "the number of host devices must be a positive int (one replica or more), got 0",
            ),
            (
                -2,
                ValueError,
                "the number of host devices must be a positive int (one replica or more), got -2",
            ),
            ("2", TypeError, "the number of host devices must be a positive int, got str '2'"),
            (True, TypeError, "the number of host devices must be a positive int, got bool True"),
            (2.0, TypeError, "the number of host devices must be a positive int, got float 2.0"),
            (
                2**64,
                ValueError,
                "the number of host devices must be at most 65536, got 18446744073709551616: "
                "each replica's host device is a worker thread of this process",
            ),
            (
                65537,
                ValueError,
                "the number of host devices must be at most 65536, got 65537: each replica's "
                "host device is a worker thread of this process",
            ),
        ],
    )
    def test_bad_count_refused(self, n: Any, error: type[Exception], message: str) -> None:
        """A count that is not a positive int, or more devices than a process can run
        replicas on, is refused at once, saying what it got."""
        with pytest.raises(error) as info:
            host_devices(n)
        assert str(info.value) == message

    def test_numpy_integers_are_counts(self) -> None:
        """A count computed with NumPy is a count, for host_devices and StrategyFactory."""
        assert host_devices(np.int64(2)) == ["cpu:0", "cpu:1"]  # type: ignore[arg-type]
        make = StrategyFactory(np.int64(3))  # type: ignore[arg-type]
        assert (type(make.replicas), make.replicas) == (int, 3)
        assert make(np.int32(2)).devices == ("cpu:0", "cpu:1")  # type: ignore[arg-type]
        assert len(host_devices(65536)) == 65536


@pytest.mark.anyio
class TestReplicaContext:
    async def test_inside_a_replica(self) -> None:
        """replica_context() and replica_id() are the running replica's."""
        strategy = MirroredStrategy(host_devices(3))
        seen: list[tuple[int, int, str]] = []

        async def step() -> None:
            context = replica_context()
            assert context is aioreplica.get_replica_context()
            seen.append((replica_id(), context.replica_id_in_sync_group, context.device.name))

        await strategy.run(step)
        assert sorted(seen) == [(0, 0, "cpu:0"), (1, 1, "cpu:1"), (2, 2, "cpu:2")]

    @pytest.mark.parametrize("helper", [replica_context, replica_id])
    async def test_cross_replica_context_fails(self, helper: Callable[[], object]) -> None:
        """In a scope outside run() and in a merge function they raise RuntimeError."""
        message = (
            "replica_context() was called in cross-replica context (a merge function, or "
            "strategy.scope() outside run()); call it from code that strategy.run() runs, "
            "and in a merge function use its strategy argument instead"
        )
        with MirroredStrategy(host_devices(2)).scope(), pytest.raises(RuntimeError) as info:
            helper()
        assert str(info.value) == message

        failures: list[str] = []

        def merge(strategy: MirroredStrategy) -> None:
            try:
                helper()
            except RuntimeError as exc:
                failures.append(str(exc))

        async def step() -> None:
            await replica_context().merge_call(merge)

        await MirroredStrategy(host_devices(2)).run(step)
        assert failures == [message]

    def test_default_replica_context_outside_any_strategy(self) -> None:
        """Outside any strategy they give the default strategy's replica (0 of 1), as TF."""
        assert replica_context() is aioreplica.get_replica_context()
        assert (replica_id(), replica_context().num_replicas_in_sync) == (0, 1)


class TestStrategyFactory:
    def test_default_count_and_host_devices(self) -> None:
        """factory() makes the factory's count of replicas on cpu:0 ..; interleave ordered."""
        make = StrategyFactory()
        strategy = make()
        assert (make.replicas, make.seed) == (2, None)
        assert strategy.devices == ("cpu:0", "cpu:1")
        assert (strategy.interleave, strategy.seed, strategy.sync_timeout) == (
            "ordered",
            None,
            None,
        )
        assert repr(make) == "StrategyFactory(replicas=2, seed=None)"

    def test_n_and_keywords_are_passed_on(self) -> None:
        """n sets the count; keyword arguments go to MirroredStrategy."""
        options = aioreplica.CommunicationOptions(timeout_seconds=3.0)
        strategy = StrategyFactory(4)(
            3, sync_timeout=2.5, interleave="random", seed=9, communication_options=options
        )
        assert strategy.devices == ("cpu:0", "cpu:1", "cpu:2")
        assert (strategy.sync_timeout, strategy.interleave, strategy.seed) == (2.5, "random", 9)

    def test_seed_makes_random_interleave(self) -> None:
        """With a seed, strategies default to interleave='random' with it; explicit wins."""
        make = StrategyFactory(2, seed=5)
        seeded, ordered, reseeded = make(), make(interleave="ordered"), make(seed=8)
        assert (seeded.interleave, seeded.seed) == ("random", 5)
        assert (ordered.interleave, ordered.seed) == ("ordered", None)
        assert (reseeded.interleave, reseeded.seed) == ("random", 8)
        assert make.made == ((2, "random", 5), (2, "ordered", None), (2, "random", 8))

    def test_made_records_drawn_seeds(self) -> None:
        """A seed MirroredStrategy draws is recorded, so a failure report can name it."""
        make = StrategyFactory(3)
        strategy = make(interleave="random")
        assert strategy.seed is not None
        assert make.made == ((3, "random", strategy.seed),)

    def test_devices_replace_host_devices(self) -> None:
        """devices= gives the replicas' devices; n, if given, must match their number."""
        devices = [FakeDevice(f"fake:{i}", i) for i in range(3)]
        make = StrategyFactory(2, seed=1)
        strategy = make(devices=devices)
        assert strategy.extended.replica_devices == tuple(devices)
        assert (strategy.interleave, strategy.seed) == ("random", 1)
        assert make(3, devices=devices).num_replicas_in_sync == 3
        with pytest.raises(
            ValueError,
            match=r"^n=2 replicas asked for with 3 devices; pass one of them, or as many "
            r"devices as replicas$",
        ):
            make(2, devices=devices)

    @pytest.mark.parametrize(
        ("n", "error", "message"),
        [
            (0, ValueError, "n must be a positive int (one replica or more), got 0"),
            ("3", TypeError, "n must be a positive int, got str '3'"),
        ],
    )
    def test_bad_n_refused(self, n: Any, error: type[Exception], message: str) -> None:
        """n that is not a positive int is refused, and nothing is recorded as made."""
        make = StrategyFactory()
        with pytest.raises(error) as info:
            make(n)
        assert str(info.value) == message
        assert make.made == ()

    def test_bad_construction_refused(self) -> None:
        """replicas must be a positive int and seed an int or None."""
        with pytest.raises(ValueError, match=r"^replicas must be a positive int .*got 0$"):
            StrategyFactory(0)
        with pytest.raises(TypeError, match=r"^seed must be an int or None, got str '1'$"):
            StrategyFactory(2, seed="1")  # type: ignore[arg-type]

    def test_strategy_errors_pass_through(self) -> None:
        """MirroredStrategy's own checks still apply (an unknown interleave, say)."""
        with pytest.raises(ValueError, match="interleave must be one of"):
            StrategyFactory()(interleave="sorted")

    @pytest.mark.anyio
    async def test_close_closes_what_it_made_but_a_running_one(self) -> None:
        """close() closes every strategy the factory made, except one whose run() is in
        progress (its threads would stop under it), which a later close() closes."""
        make = StrategyFactory(2)
        idle, busy = make(), make()
        release = anyio.Event()
        events: list[tuple[str, bool, bool]] = []

        async def step() -> None:
            await release.wait()

        async with anyio.create_task_group() as group:
            group.start_soon(busy.run, step)
            await anyio.wait_all_tasks_blocked()
            make.close()
            events.append(("during the run", idle.closed, busy.closed))
            release.set()
        make.close()
        events.append(("after it", idle.closed, busy.closed))
        assert events == [("during the run", True, False), ("after it", True, True)]

    def test_the_fixture_closes_its_strategies_and_their_traces(
        self, pytester: pytest.Pytester
    ) -> None:
        """At teardown, strategy_factory closes the strategies it made: their traces are
        written and stopped, and another test can start one."""
        result = run_inner(
            pytester,
            """
            import os
            import pytest

            made = []

            def test_leaves_a_trace_running(strategy_factory, tmp_path_factory):
                strategy = strategy_factory()
                path = tmp_path_factory.getbasetemp() / "left.json"
                strategy.start_trace(path)
                made.append((strategy, path))

            def test_next(strategy_factory, tmp_path):
                ((strategy, path),) = made
                assert strategy.closed and os.path.exists(path)
                strategy_factory().start_trace(tmp_path / "next.json")
            """,
        )
        result.assert_outcomes(passed=2)


class TestFakeDevice:
    def test_is_a_device(self) -> None:
        """Fake and recording devices implement the Device protocol, with their own names."""
        fake, recording = FakeDevice("fake:3", 3), RecordingDevice(1, DeviceLog())
        assert isinstance(fake, aioreplica.Device)
        assert isinstance(recording, aioreplica.Device)
        assert (fake.name, fake.index, fake.kind, fake.has_context) == ("fake:3", 3, "cpu", True)
        assert (recording.name, RecordingDevice(1, DeviceLog(), name="r").name) == ("rec:1", "r")
        assert repr(fake) == "<FakeDevice fake:3>"
        assert fake.xp is np
        assert fake.asarray([1, 2]).tolist() == [1, 2]

    @pytest.mark.anyio
    @pytest.mark.parametrize("inline", [False, True])
    async def test_run_thread_and_context(self, inline: bool) -> None:
        """run() uses a worker thread, or the loop thread when inline; both run fn in a copy
        of the caller's context (it sees the caller's values; what it sets stays inside)."""
        var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
        var.set("caller")
        device = FakeDevice("fake:0", inline=inline)

        def job(x: int) -> tuple[bool, str, int]:
            seen = var.get()
            var.set("job")
            return threading.get_ident() == loop_thread, seen, x * 2

        loop_thread = threading.get_ident()
        assert await device.run(job, 21) == (inline, "caller", 42)
        assert await device.compute(8, job, 1) == (inline, "caller", 2)
        await device.synchronize()
        assert var.get() == "caller"

    @pytest.mark.anyio
    @pytest.mark.parametrize("inline", [False, True])
    async def test_errors_come_back(self, inline: bool) -> None:
        """An exception raised by the work comes out of run()."""
        with pytest.raises(ZeroDivisionError):
            await FakeDevice("fake:0", inline=inline).run(divmod, 1, 0)

    @pytest.mark.anyio
    async def test_inline_runs_repeat_exactly(self) -> None:
        """Inline fake devices under a seeded random interleave give one event order per seed."""

        async def events(seed: int) -> list[tuple[str, int]]:
            devices = [FakeDevice(f"fake:{i}", i, inline=True) for i in range(4)]
            strategy = MirroredStrategy(devices, interleave="random", seed=seed)
            log: list[tuple[str, int]] = []

            async def step() -> None:
                me = replica_id()
                for round_number in range(3):
                    await replica_context().device.run(log.append, (f"job {round_number}", me))
                    await replica_context().merge_call(lambda strategy: None)
                    log.append((f"resume {round_number}", me))

            await strategy.run(step)
            return log

        first = await events(4)
        assert sorted(first) == sorted(
            (f"{kind} {r}", i) for kind in ("job", "resume") for r in range(3) for i in range(4)
        )
        assert await events(4) == first
        assert await events(4) == first


class TestRecordingDevice:
    def test_log_records_pairs_and_misuse(self) -> None:
        """enter/leave set the log's current device; nesting and bad leaves are errors."""
        log = DeviceLog()
        a, b = RecordingDevice(0, log), RecordingDevice(1, log)
        current: list[str | None] = []
        for action in (a.enter, a.leave, a.enter, b.enter, a.leave):
            action()
            current.append(log.current)
        assert current == ["rec:0", None, "rec:0", "rec:1", None]
        assert log.events == [
            ("enter", "rec:0"),
            ("leave", "rec:0"),
            ("enter", "rec:0"),
            ("nested enter", "rec:1"),
            ("enter", "rec:1"),
            ("bad leave", "rec:0"),
            ("leave", "rec:0"),
        ]
        assert log.errors() == [("nested enter", "rec:1"), ("bad leave", "rec:0")]

    @pytest.mark.anyio
    async def test_each_replica_sees_its_own_device(self) -> None:
        """In a run, replica code sees its own device current; none is current outside."""
        log = DeviceLog()
        strategy = MirroredStrategy([RecordingDevice(i, log) for i in range(3)])
        seen: list[tuple[int, str | None]] = []

        async def step() -> None:
            seen.append((replica_id(), log.current))
            await anyio.lowlevel.checkpoint()
            seen.append((replica_id(), log.current))

        await strategy.run(step)
        assert sorted(seen) == [(i, f"rec:{i}") for i in range(3) for _ in range(2)]
        assert (log.current, log.errors()) == (None, [])
        assert log.events[0::2] == [("enter", name) for _, name in log.events[1::2]]
        assert {name for _, name in log.events} == {"rec:0", "rec:1", "rec:2"}


class TestReplicasMarker:
    def test_marker_parametrizes_over_counts(self, pytester: pytest.Pytester) -> None:
        """@pytest.mark.replicas(1, 2, 4) runs the test once per count, ids replicas=N."""
        result = run_inner(
            pytester,
            """
            import pytest

            @pytest.mark.replicas(1, 2, 4)
            def test_count(strategy_factory, replicas):
                strategy = strategy_factory()
                assert strategy.devices == tuple(f"cpu:{i}" for i in range(replicas))
                assert strategy_factory(3).num_replicas_in_sync == 3
            """,
        )
        result.assert_outcomes(passed=3)
        assert passed_ids(result) == [
            "test_count[replicas=1]",
            "test_count[replicas=2]",
            "test_count[replicas=4]",
        ]

    def test_default_is_two_and_only_users_are_parametrized(
        self, pytester: pytest.Pytester
    ) -> None:
        """Unmarked users of strategy_factory or replicas get [replicas=2]; others nothing."""
        result = run_inner(
            pytester,
            """
            import pytest

            @pytest.fixture
            def pair(strategy_factory):
                return strategy_factory()

            def test_factory(strategy_factory):
                assert strategy_factory().num_replicas_in_sync == 2

            def test_count(replicas):
                assert replicas == 2

            def test_through_a_fixture(pair):
                assert pair.num_replicas_in_sync == 2

            def test_plain():
                pass

            @pytest.mark.parametrize("x", [1, 2])
            def test_other_parameters(x):
                pass
            """,
        )
        result.assert_outcomes(passed=6)
        assert passed_ids(result) == [
            "test_factory[replicas=2]",
            "test_count[replicas=2]",
            "test_through_a_fixture[replicas=2]",
            "test_plain",
            "test_other_parameters[1]",
            "test_other_parameters[2]",
        ]

    def test_option_gives_counts_of_unmarked_tests(self, pytester: pytest.Pytester) -> None:
        """--aioreplica-replicas=1,3 parametrizes unmarked tests; a marker still wins."""
        result = run_inner(
            pytester,
            """
            import pytest

            def test_unmarked(strategy_factory, replicas):
                assert strategy_factory().num_replicas_in_sync == replicas

            @pytest.mark.replicas(2)
            def test_marked(replicas):
                assert replicas == 2
            """,
            "--aioreplica-replicas=1, 3",
        )
        result.assert_outcomes(passed=3)
        assert passed_ids(result) == [
            "test_unmarked[replicas=1]",
            "test_unmarked[replicas=3]",
            "test_marked[replicas=2]",
        ]

    def test_closest_marker_wins(self, pytester: pytest.Pytester) -> None:
        """A module or class marker applies to its tests; the test's own marker wins."""
        result = run_inner(
            pytester,
            """
            import pytest

            pytestmark = pytest.mark.replicas(3)

            def test_module(replicas):
                assert replicas == 3

            def test_not_a_user():
                pass

            @pytest.mark.replicas(1, 2)
            class TestClass:
                def test_class(self, replicas):
                    assert replicas in (1, 2)

                @pytest.mark.replicas(4)
                def test_own(self, replicas):
                    assert replicas == 4
            """,
        )
        result.assert_outcomes(passed=5)
        assert passed_ids(result) == [
            "test_module[replicas=3]",
            "test_not_a_user",
            "TestClass::test_class[replicas=1]",
            "TestClass::test_class[replicas=2]",
            "TestClass::test_own[replicas=4]",
        ]

    def test_own_parametrization_of_replicas_is_kept(self, pytester: pytest.Pytester) -> None:
        """A test that parametrizes replicas itself keeps its values; the factory uses them."""
        result = run_inner(
            pytester,
            """
            import pytest

            @pytest.mark.parametrize("replicas", [3, 5])
            def test_own(strategy_factory, replicas):
                assert strategy_factory().num_replicas_in_sync == replicas
            """,
            "--aioreplica-replicas=1,2",
        )
        result.assert_outcomes(passed=2)
        assert passed_ids(result) == ["test_own[3]", "test_own[5]"]

    def test_marker_on_a_parameter_wins_for_its_items(self, pytester: pytest.Pytester) -> None:
        """A replicas marker on a pytest.param (of the test's parametrize, or of a fixture's
        params) gives that parameter's items their counts; the others keep the test's."""
        result = run_inner(
            pytester,
            """
            import pytest

            @pytest.mark.parametrize("x", [1, pytest.param(2, marks=pytest.mark.replicas(4, 1))])
            def test_param(strategy_factory, replicas, x):
                assert strategy_factory().num_replicas_in_sync == replicas

            @pytest.fixture(params=["a", pytest.param("b", marks=pytest.mark.replicas(1))])
            def letter(request):
                return request.param

            @pytest.mark.replicas(1, 2)
            def test_fixture(letter, replicas):
                pass
            """,
        )
        result.assert_outcomes(passed=6, deselected=4)
        assert passed_ids(result) == [
            "test_param[replicas=2-1]",
            "test_param[replicas=4-2]",
            "test_param[replicas=1-2]",
            "test_fixture[a-replicas=1]",
            "test_fixture[a-replicas=2]",
            "test_fixture[b-replicas=1]",
        ]

    def test_marker_on_a_fixture_parameter_needs_a_count_of_the_test(
        self, pytester: pytest.Pytester
    ) -> None:
        """A fixture parameter's marker naming a count the test does not run with (seen only
        after the test was parametrized) fails that parameter's items at setup, saying so."""
        result = run_inner(
            pytester,
            """
            import pytest

            @pytest.fixture(params=["a", pytest.param("b", marks=pytest.mark.replicas(3))])
            def letter(request):
                return request.param

            def test_fixture(letter, replicas):
                pass
            """,
        )
        result.assert_outcomes(passed=1, errors=1)
        assert passed_ids(result) == ["test_fixture[a-replicas=2]"]
        assert (
            "@pytest.mark.replicas(3) on a parameter of test_fixture: the test does not run "
            "with replica count 3 (it runs with 2); a fixture's parameter can only pick among "
            "those: put the counts on the test (@pytest.mark.replicas) or on a pytest.param of "
            "its own parametrize"
        ) in result.outlines

    @pytest.mark.parametrize(
        ("source", "message"),
        [
            (
                "@pytest.mark.parametrize('x', [pytest.param(1, marks=pytest.mark.replicas(0))])"
                "\ndef test_it(replicas, x):",
                REPLICAS_USAGE + "0",
            ),
            (
                "@pytest.mark.parametrize('x', [pytest.param(1, marks=pytest.mark.replicas(2))])"
                "\ndef test_it(x):",
                "@pytest.mark.replicas on test_it (on a parameter), which uses neither the "
                "strategy_factory nor the replicas fixture: the marker would do nothing",
            ),
        ],
        ids=["zero", "unused"],
    )
    def test_bad_marker_on_a_parameter_is_a_collection_error(
        self, pytester: pytest.Pytester, source: str, message: str
    ) -> None:
        """A parameter's malformed or useless marker fails collection of its test."""
        result = run_inner(pytester, f"import pytest\n\n{source}\n    pass\n")
        result.assert_outcomes(errors=1)
        assert message in result.outlines

    @pytest.mark.parametrize(
        ("decorator", "message"),
        [
            (
                "@pytest.mark.replicas()",
                REPLICAS_USAGE + "no arguments",
            ),
            (
                "@pytest.mark.replicas(2, 0)",
                REPLICAS_USAGE + "0",
            ),
            (
                "@pytest.mark.replicas('2')",
                REPLICAS_USAGE + "'2'",
            ),
            (
                "@pytest.mark.replicas(2, count=4)",
                REPLICAS_USAGE + "keyword arguments count=4",
            ),
            (
                "@pytest.mark.replicas(2, 2)",
                "@pytest.mark.replicas on test_it: replica count 2 appears twice",
            ),
            (
                "@pytest.mark.replicas(2)\n@pytest.mark.parametrize('replicas', [1])",
                "test_it parametrizes replicas itself and has @pytest.mark.replicas; keep one "
                "of them",
            ),
        ],
        ids=["empty", "zero", "string", "keyword", "twice", "and-parametrize"],
    )
    def test_bad_marker_is_a_collection_error(
        self, pytester: pytest.Pytester, decorator: str, message: str
    ) -> None:
        """A malformed marker fails collection of its test with a message saying why."""
        result = run_inner(
            pytester, f"import pytest\n\n{decorator}\ndef test_it(replicas):\n    pass\n"
        )
        result.assert_outcomes(errors=1)
        assert message in result.outlines

    def test_marker_on_a_test_without_the_fixtures(self, pytester: pytest.Pytester) -> None:
        """The marker on a test that uses neither fixture would do nothing: an error."""
        result = run_inner(
            pytester, "import pytest\n\n@pytest.mark.replicas(2)\ndef test_it():\n    pass\n"
        )
        result.assert_outcomes(errors=1)
        assert (
            "@pytest.mark.replicas on test_it, which uses neither the strategy_factory nor the "
            "replicas fixture: the marker would do nothing"
        ) in result.outlines

    @pytest.mark.parametrize(
        ("value", "message"),
        [
            (
                "1,x",
                "expected replica counts such as 1,2,4 (positive integers separated by "
                "commas), got '1,x'",
            ),
            (
                "0",
                "expected replica counts such as 1,2,4 (positive integers separated by "
                "commas), got '0'",
            ),
            ("2,4,2", "replica count 2 appears twice in '2,4,2'"),
        ],
    )
    def test_bad_option_is_a_usage_error(
        self, pytester: pytest.Pytester, value: str, message: str
    ) -> None:
        """A malformed --aioreplica-replicas stops pytest with a usage error saying why."""
        result = run_inner(pytester, "def test_it():\n    pass\n", f"--aioreplica-replicas={value}")
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines([f"*error: argument --aioreplica-replicas: {message}"])

    def test_markers_are_registered(self, pytester: pytest.Pytester) -> None:
        """pytest --markers lists both markers (so --strict-markers accepts them)."""
        result = run_inner(pytester, "", "--markers")
        result.stdout.fnmatch_lines(
            [
                "@pytest.mark.replicas(*counts): run the test once per replica count*",
                "@pytest.mark.interleavings(n): run the test once per seed 0..n-1*",
            ]
        )


class TestInterleavingsMarker:
    def test_one_item_per_seed(self, pytester: pytest.Pytester) -> None:
        """interleavings(3) makes the items seed=0..2; their strategies use that seed."""
        result = run_inner(
            pytester,
            """
            import pytest

            @pytest.mark.interleavings(3)
            def test_seeded(strategy_factory, interleave_seed):
                strategy = strategy_factory()
                assert (strategy.interleave, strategy.seed) == ("random", interleave_seed)

            @pytest.mark.replicas(1, 2)
            @pytest.mark.interleavings(2)
            def test_both(strategy_factory, replicas, interleave_seed):
                assert strategy_factory().num_replicas_in_sync == replicas

            def test_unseeded(strategy_factory, interleave_seed):
                assert interleave_seed is None
                assert strategy_factory().interleave == "ordered"
            """,
        )
        result.assert_outcomes(passed=8)
        assert passed_ids(result) == [
            "test_seeded[replicas=2-seed=0]",
            "test_seeded[replicas=2-seed=1]",
            "test_seeded[replicas=2-seed=2]",
            "test_both[replicas=1-seed=0]",
            "test_both[replicas=1-seed=1]",
            "test_both[replicas=2-seed=0]",
            "test_both[replicas=2-seed=1]",
            "test_unseeded[replicas=2]",
        ]

    def test_failure_names_the_seed(self, pytester: pytest.Pytester) -> None:
        """A failing item names its seed in its id and in the report's aioreplica section."""
        result = run_inner(
            pytester,
            """
            import pytest

            @pytest.mark.interleavings(3)
            def test_fails_on_one_seed(strategy_factory):
                strategy = strategy_factory(4)
                assert strategy.seed != 1
            """,
        )
        result.assert_outcomes(passed=2, failed=1)
        result.stdout.fnmatch_lines(
            [
                "*_ test_fails_on_one_seed[[]replicas=2-seed=1[]] _*",
                "*- aioreplica -*",
                "@pytest.mark.interleavings item with seed=1: its strategies from "
                "strategy_factory default to that seed",
                "strategy 1 from strategy_factory: 4 replicas, interleave='random', seed=1 "
                "(replay: MirroredStrategy(..., interleave='random', seed=1))",
            ],
            consecutive=False,
        )
        result.stdout.fnmatch_lines(
            ["FAILED test_inner.py::test_fails_on_one_seed[[]replicas=2-seed=1[]] - *"]
        )

    def test_failure_without_a_seed_lists_the_strategies(self, pytester: pytest.Pytester) -> None:
        """Any failing test that made strategies names them (a drawn seed included)."""
        result = run_inner(
            pytester,
            """
            def test_fails(strategy_factory):
                strategy_factory(3)
                seeded = strategy_factory(interleave="random", seed=12)
                assert seeded.seed == 0
            """,
        )
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines(
            [
                "*- aioreplica -*",
                "strategy 1 from strategy_factory: 3 replicas, interleave='ordered'",
                "strategy 2 from strategy_factory: 2 replicas, interleave='random', seed=12 "
                "(replay: MirroredStrategy(..., interleave='random', seed=12))",
            ],
            consecutive=True,
        )

    def test_passing_tests_have_no_section(self, pytester: pytest.Pytester) -> None:
        """Only failures get the section; -rA shows passing items without it."""
        result = run_inner(
            pytester,
            """
            import pytest

            @pytest.mark.interleavings(2)
            def test_passes(strategy_factory):
                strategy_factory()
            """,
            "-rA",
        )
        result.assert_outcomes(passed=2)
        assert not [line for line in result.outlines if "- aioreplica -" in line]

    @pytest.mark.parametrize(
        ("decorator", "uses", "message"),
        [
            (
                "@pytest.mark.interleavings(0)",
                "strategy_factory",
                INTERLEAVINGS_USAGE + "0",
            ),
            (
                "@pytest.mark.interleavings(2, 3)",
                "strategy_factory",
                INTERLEAVINGS_USAGE + "2 arguments (2, 3)",
            ),
            (
                "@pytest.mark.interleavings(2)",
                "",
                "@pytest.mark.interleavings on test_it, which uses neither the "
                "strategy_factory nor the interleave_seed fixture: the marker would do nothing",
            ),
        ],
        ids=["zero", "two-numbers", "no-fixture"],
    )
    def test_bad_marker_is_a_collection_error(
        self, pytester: pytest.Pytester, decorator: str, uses: str, message: str
    ) -> None:
        """A malformed or useless interleavings marker fails collection, saying why."""
        result = run_inner(
            pytester, f"import pytest\n\n{decorator}\ndef test_it({uses}):\n    pass\n"
        )
        result.assert_outcomes(errors=1)
        assert message in result.outlines


class TestEventLoopPlugins:
    STEP = """
    from aioreplica.testing import replica_context, replica_id

    async def run_sum(strategy):
        async def step():
            value = float(replica_id())
            return float(await replica_context().all_reduce("sum", value))

        return strategy.experimental_local_results(await strategy.run(step))
    """

    def test_pytest_asyncio_strict_mode(self, pytester: pytest.Pytester) -> None:
        """@pytest.mark.asyncio tests use the fixtures and markers in strict mode."""
        result = run_inner(
            pytester,
            self.STEP
            + """
    import pytest
    import pytest_asyncio

    @pytest_asyncio.fixture
    async def summed(strategy_factory):
        return await run_sum(strategy_factory())

    @pytest.mark.asyncio
    @pytest.mark.replicas(1, 3)
    @pytest.mark.interleavings(2)
    async def test_sum(strategy_factory, replicas):
        total = sum(range(replicas))
        assert await run_sum(strategy_factory()) == (total,) * replicas

    @pytest.mark.asyncio
    @pytest.mark.replicas(2)
    async def test_async_fixture(summed):
        assert summed == (1.0, 1.0)
            """,
        )
        result.assert_outcomes(passed=5)
        assert passed_ids(result) == [
            "test_sum[replicas=1-seed=0]",
            "test_sum[replicas=1-seed=1]",
            "test_sum[replicas=3-seed=0]",
            "test_sum[replicas=3-seed=1]",
            "test_async_fixture[replicas=2]",
        ]

    def test_anyio_plugin_on_asyncio_and_trio(self, pytester: pytest.Pytester) -> None:
        """@pytest.mark.anyio tests use them on every backend anyio_backend gives."""
        result = run_inner(
            pytester,
            self.STEP
            + """
    import pytest

    @pytest.fixture(params=["asyncio", "trio"])
    def anyio_backend(request):
        return request.param

    @pytest.mark.anyio
    @pytest.mark.replicas(2, 4)
    async def test_sum(strategy_factory, replicas):
        total = sum(range(replicas))
        assert await run_sum(strategy_factory()) == (total,) * replicas
            """,
        )
        result.assert_outcomes(passed=4)
        assert sorted(passed_ids(result)) == [
            "test_sum[asyncio-replicas=2]",
            "test_sum[asyncio-replicas=4]",
            "test_sum[trio-replicas=2]",
            "test_sum[trio-replicas=4]",
        ]


class TestDocumentedExample:
    def test_module_docstring_example_runs(self, pytester: pytest.Pytester) -> None:
        """The test module in the plugin's docstring passes, with the ids it describes."""
        doc = aioreplica.testing.__doc__ or ""
        example = doc.split("Example of a test module (not a doctest)::\n", 1)[1]
        source = example.split("\n\nHelpers for the tests themselves", 1)[0]
        result = run_inner(pytester, textwrap.dedent(source))
        ids = passed_ids(result)
        assert result.ret == pytest.ExitCode.OK
        assert {"test_sum[asyncio-replicas=1]", "test_sum[asyncio-replicas=4]"} <= set(ids)
        seeded = [i for i in ids if i.startswith("test_order_does_not_matter[asyncio-")]
        assert seeded == [
            f"test_order_does_not_matter[asyncio-replicas=2-seed={s}]" for s in range(20)
        ]


class TestRegistration:
    def test_loaded_through_the_entry_point(self, pytestconfig: pytest.Config) -> None:
        """pytest loaded this module as the plugin named aioreplica."""
        assert pytestconfig.pluginmanager.get_plugin("aioreplica") is aioreplica.testing

    def test_can_be_turned_off(self, pytester: pytest.Pytester) -> None:
        """-p no:aioreplica removes the fixtures and markers."""
        result = run_inner(
            pytester, "def test_it(strategy_factory):\n    pass\n", "-p", "no:aioreplica"
        )
        result.assert_outcomes(errors=1)
        result.stdout.fnmatch_lines(["*fixture 'strategy_factory' not found*"])

    def test_import_aioreplica_loads_neither_plugin_nor_pytest(self) -> None:
        """``import aioreplica`` imports neither aioreplica.testing nor pytest."""
        code = (
            "import json, sys\n"
            "import aioreplica\n"
            "print(json.dumps(sorted(m for m in sys.modules\n"
            "      if m == 'aioreplica.testing' or m.split('.')[0] in ('pytest', '_pytest'))))\n"
        )
        completed = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=20
        )
        assert (completed.returncode, completed.stderr) == (0, "")
        assert json.loads(completed.stdout) == []


class TestPublicSurface:
    def test_all_sorted_and_present(self) -> None:
        """``__all__`` names the helpers, in isort order, and each exists."""
        assert aioreplica.testing.__all__ == [
            "DeviceLog",
            "FakeDevice",
            "RecordingDevice",
            "StrategyFactory",
            "host_devices",
            "replica_context",
            "replica_id",
        ]
        for name in aioreplica.testing.__all__:
            assert getattr(aioreplica.testing, name).__module__ == "aioreplica.testing"

    def test_every_public_callable_has_an_example(self) -> None:
        """Public functions, classes and their public methods show an example."""
        missing = []
        for name in aioreplica.testing.__all__:
            obj = getattr(aioreplica.testing, name)
            members = [(name, obj)]
            if isinstance(obj, type):
                members += [
                    (f"{name}.{attr}", value)
                    for attr, value in vars(obj).items()
                    if inspect.isfunction(value) and attr in ("__call__", "errors", "run")
                ]
            missing += [
                label for label, member in members if "Example" not in (member.__doc__ or "")
            ]
        assert missing == []

    @pytest.mark.parametrize(
        "name",
        ["host_devices", "replica_context", "replica_id", "StrategyFactory", "FakeDevice.run"],
    )
    def test_raising_callables_document_it(self, name: str) -> None:
        """Callables that raise on misuse have a Raises section."""
        obj: Any = aioreplica.testing
        for part in name.split("."):
            obj = getattr(obj, part)
        assert "Raises:" in (obj.__doc__ or "")
        if name == "StrategyFactory":
            assert "Raises:" in (obj.__call__.__doc__ or "")
