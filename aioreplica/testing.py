"""The pytest plugin for code that runs on replicas, and helpers for its tests.

Installing aioreplica registers this module with pytest (entry point ``pytest11``, plugin
name ``aioreplica``; ``pytest -p no:aioreplica`` turns it off). ``import aioreplica`` never
imports it, nor pytest.

Fixtures:

- ``strategy_factory``: a ``StrategyFactory``. ``strategy_factory(n=None, **kwargs)`` returns
  a ``MirroredStrategy`` over the host devices ``cpu:0`` ... ``cpu:{n-1}``; the keyword
  arguments (``interleave``, ``seed``, ``sync_timeout``, ...) go to ``MirroredStrategy``, and
  ``devices=`` replaces the host devices (fake devices, say). ``n=None`` means the test's
  replica count. At the test's teardown the fixture closes every strategy it made (their
  devices' worker threads stop unless another open strategy uses them, and a trace one of them
  still records is written), so no thread or trace outlives the test.
- ``replicas``: the test's replica count (an ``int``), for tests that need the number itself.
- ``interleave_seed``: the seed of an ``interleavings`` item, else ``None``.

The replica count of a test comes from the closest ``@pytest.mark.replicas(1, 2, 4)`` marker
(function, then class, then module), else from ``--aioreplica-replicas=1,2,4`` (default
``2``), and the test runs once per count, with ids such as ``test_step[replicas=4]``. A
marker on one parameter (``pytest.param(2, marks=pytest.mark.replicas(4))`` in the test's
``parametrize``, or in a fixture's ``params``) wins for that parameter's items: they run with
its counts only (items of other counts are deselected). A fixture's parameter can only pick
among the counts the test runs with otherwise: a count it names that the test does not run
with fails its items at setup, saying so. Only
tests that use ``strategy_factory`` or ``replicas`` (directly or through another fixture) are
parametrized, so the plugin leaves every other test of a suite alone; the marker on a test
that uses neither is a collection error. A test that parametrizes ``replicas`` itself
(``@pytest.mark.parametrize("replicas", ...)``) keeps its own values. The option is for tests
written for any count: give a test written for particular counts its marker
(``@pytest.mark.replicas(3)``), so that ``--aioreplica-replicas`` does not run it again under
counts it ignores.

``@pytest.mark.interleavings(n)`` runs a test ``n`` times, as the items ``[seed=0]`` ...
``[seed={n-1}]``: in each, the strategies ``strategy_factory`` makes resume their replicas in
the seeded random order of ``interleave="random"`` with that seed (an explicit
``interleave=`` or ``seed=`` argument wins). A failing item names its seed in its id, and its
report has an ``aioreplica`` section naming the strategies the test made (replica count,
interleave, seed): ``MirroredStrategy(..., interleave="random", seed=3)`` replays the order.
With both markers a test runs once per count and seed (``[replicas=4-seed=3]``).

The plugin works with pytest-asyncio in strict mode (``@pytest.mark.asyncio``) and with
anyio's plugin (``@pytest.mark.anyio``): the fixtures are plain synchronous ones.

Example of a test module (not a doctest)::

    import pytest
    from aioreplica.testing import StrategyFactory, replica_context, replica_id

    @pytest.mark.anyio
    @pytest.mark.replicas(1, 2, 4)
    async def test_sum(strategy_factory: StrategyFactory, replicas: int) -> None:
        strategy = strategy_factory()

        async def step() -> float:
            return float(await replica_context().all_reduce("sum", float(replica_id())))

        result = await strategy.run(step)
        assert strategy.experimental_local_results(result) == (sum(range(replicas)),) * replicas

    @pytest.mark.anyio
    @pytest.mark.interleavings(20)
    async def test_order_does_not_matter(strategy_factory: StrategyFactory) -> None:
        strategy = strategy_factory(3)  # 3 replicas, interleave="random", seed=0 ... 19
        ...

Helpers for the tests themselves: ``host_devices(n)`` (the names ``cpu:0`` ...),
``replica_context()`` and ``replica_id()`` (the current replica's, failing in cross-replica
context), ``FakeDevice`` (a third-party ``Device`` over a host device; ``inline=True`` runs
its work at once on the event loop thread, so only the strategy's seeded order and the
test's own awaits decide the order of a run) and
``RecordingDevice`` with its ``DeviceLog`` (a device whose "current device" is process state,
as CuPy's is, logging every ``enter``/``leave``).
"""

from __future__ import annotations

import argparse
import contextvars
from typing import TYPE_CHECKING, Any, Final, TypeVar, final

import pytest

from ._backends import HostDevice
from ._context import get_replica_context
from ._errors import as_integer, checked_integer
from ._strategy import MirroredStrategy

if TYPE_CHECKING:
    from collections.abc import Callable, Generator, Sequence
    from types import ModuleType

    from ._backends import ArrayBackend, Device
    from ._context import ReplicaContext

__all__ = [
    "DeviceLog",
    "FakeDevice",
    "RecordingDevice",
    "StrategyFactory",
    "host_devices",
    "replica_context",
    "replica_id",
]

T = TypeVar("T")

#: The replica counts of tests without a ``replicas`` marker, unless the option says others.
DEFAULT_REPLICAS: Final = 2

#: The most host devices ``host_devices`` names: each is a worker thread of this process, and
#: each replica a coroutine; far more than a test needs (the suite runs 2,000).
MAX_HOST_DEVICES: Final = 65536


# -- helpers for tests -------------------------------------------------------------------


def _count(n: object, what: str) -> int:
    """``n`` as a replica count (a Python int; NumPy's integers are taken), or a
    ``TypeError``/``ValueError`` naming ``what``."""
    count = as_integer(n)
    if count is None:
        raise TypeError(f"{what} must be a positive int, got {type(n).__name__} {n!r:.60}")
    if count < 1:
        raise ValueError(f"{what} must be a positive int (one replica or more), got {count}")
    if count > MAX_HOST_DEVICES:
        raise ValueError(
            f"{what} must be at most {MAX_HOST_DEVICES}, got {count}: each replica's host "
            "device is a worker thread of this process"
        )
    return count


def host_devices(n: int) -> list[str]:
    """The names of ``n`` logical host devices, ``cpu:0`` to ``cpu:{n-1}``.

    Args:
        n: how many devices (one per replica).

    Returns:
        The device names, in replica order: what ``MirroredStrategy`` takes.

    Raises:
        TypeError: ``n`` is not an int (NumPy's integers are; a bool is not).
        ValueError: ``n`` is below 1, or above 65536: each device is a worker thread of this
            process.

    Example:
        >>> host_devices(3)
        ['cpu:0', 'cpu:1', 'cpu:2']
        >>> aioreplica.MirroredStrategy(host_devices(2)).num_replicas_in_sync
        2
    """
    return [f"cpu:{i}" for i in range(_count(n, "the number of host devices"))]


def replica_context() -> ReplicaContext:
    """The current replica's context, for test code that runs inside a replica.

    Unlike ``aioreplica.get_replica_context()``, which returns ``None`` in cross-replica
    context, this fails, so a test never calls ``merge_call`` on ``None``. Outside any
    strategy it is the default strategy's replica context (replica 0 of 1), as in TF.

    Returns:
        The ``ReplicaContext`` of the replica running this code.

    Raises:
        RuntimeError: the code runs in cross-replica context: in a merge function, or in a
            strategy's ``scope()`` outside ``run()``.

    Example:
        >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> async def step():
        ...     return replica_context().replica_id_in_sync_group
        >>> anyio.run(strategy.run, step)
        PerReplica({0: 0, 1: 1})
    """
    context = get_replica_context()
    if context is None:
        raise RuntimeError(
            "replica_context() was called in cross-replica context (a merge function, or "
            "strategy.scope() outside run()); call it from code that strategy.run() runs, "
            "and in a merge function use its strategy argument instead"
        )
    return context


def replica_id() -> int:
    """The id of the replica running this code (``replica_id_in_sync_group``).

    Returns:
        The replica id, ``0`` to ``num_replicas_in_sync - 1``.

    Raises:
        RuntimeError: the code runs in cross-replica context (see ``replica_context``).

    Example:
        >>> strategy = aioreplica.MirroredStrategy(host_devices(3))
        >>> async def step():
        ...     return 10 * replica_id()
        >>> anyio.run(strategy.run, step)
        PerReplica({0: 0, 1: 10, 2: 20})
    """
    return replica_context().replica_id_in_sync_group


# -- fake devices ------------------------------------------------------------------------


class FakeDevice:
    """A third-party ``Device``: arrays and work go to a logical host device of its own.

    It implements the whole ``Device`` protocol, with a name of its choosing and a context
    (``has_context`` is true, so the scheduler calls ``enter``/``leave`` around every step of
    a replica), and subclasses can override any part: a ``run`` that records, blocks or
    fails, an ``xp`` that counts calls. It is of kind ``"cpu"``, so collectives over fake
    devices use the host backend.

    Args:
        name: the device name (it need not look like ``cpu:N``).
        index: the device's number, and the index of the host device behind it.
        inline: run work (``run``, ``compute``, ``synchronize``) at once on the event loop
            thread, without yielding to the loop, instead of on the host device's worker
            thread. Device work then adds no scheduling point and nothing depends on thread
            timing: the order of a run is the strategy's (seeded) order of starts and merge
            points, interleaved only at the test's own awaits, the same on every run.

    Raises:
        TypeError: ``name`` is not a str, ``index`` not an int (a bool is not one), ``inline``
            not a bool.
        ValueError: ``name`` is empty, or ``index`` negative.

    Example:
        >>> devices = [FakeDevice(f"fake:{i}", i, inline=True) for i in range(2)]
        >>> strategy = aioreplica.MirroredStrategy(devices)
        >>> async def step():
        ...     device = replica_context().device
        ...     total = await device.run(np.sum, device.asarray([1.0, 2.0]))
        ...     return f"{device.name}: {total}"
        >>> anyio.run(strategy.run, step)
        PerReplica({0: 'fake:0: 3.0', 1: 'fake:1: 3.0'})
    """

    kind = "cpu"
    has_context = True

    def __init__(self, name: str, index: int = 0, *, inline: bool = False) -> None:
        if not isinstance(name, str):
            raise TypeError(
                f"{type(self).__name__}: name must be a str, got {type(name).__name__} {name!r}"
            )
        if not name:
            raise ValueError(f"{type(self).__name__}: name must not be empty")
        index = checked_integer(index, f"{type(self).__name__}: index must be an int >= 0", 0)
        if not isinstance(inline, bool):
            raise TypeError(
                f"{type(self).__name__}: inline must be True or False, got "
                f"{type(inline).__name__} {inline!r}"
            )
        self.name = name
        self.index = index
        self.inline = inline
        self._host: HostDevice = HostDevice(index)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    @property
    def xp(self) -> ModuleType:
        """The array module: NumPy."""
        return self._host.xp

    @property
    def backend(self) -> ArrayBackend:
        """The host backend."""
        return self._host.backend

    async def compute(self, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` as ``run`` does, whatever its size.

        Raises:
            BaseException: whatever ``fn`` raises.

        Example:
            >>> anyio.run(FakeDevice("fake:0").compute, 16, sum, [1, 2])
            3
        """
        return await self.run(fn, *args)

    def enter(self) -> None:
        """Make this device current: nothing to do (``RecordingDevice`` records it)."""

    def leave(self) -> None:
        """Stop this device being current: nothing to do."""

    def asarray(self, value: Any) -> Any:
        """``value`` as a NumPy array.

        Example:
            >>> FakeDevice("fake:0").asarray([1, 2]).tolist()
            [1, 2]
        """
        return self._host.asarray(value)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` in a copy of the caller's context; await its result.

        On the host device's worker thread, or at once on the loop thread if ``inline``.

        Raises:
            BaseException: whatever ``fn`` raises.

        Example:
            >>> anyio.run(FakeDevice("fake:0", inline=True).run, max, 3, 5)
            5
        """
        if self.inline:
            return contextvars.copy_context().run(fn, *args, **kwargs)
        return await self._host.run(fn, *args, **kwargs)

    async def synchronize(self) -> None:
        """Wait until the work queued on this device so far has finished.

        Example:
            >>> anyio.run(FakeDevice("fake:0").synchronize)
        """
        if not self.inline:  # inline work has all finished
            await self._host.synchronize()


@final
class DeviceLog:
    """The shared "current device" of a group of ``RecordingDevice``s, and what they did.

    Attributes:
        current: the name of the device entered and not yet left, or ``None``.
        events: ``("enter", name)`` and ``("leave", name)`` in the order they happened, with
            ``("nested enter", name)`` where a device was entered while another was current
            and ``("bad leave", name)`` where a device that was not current was left.

    Example:
        >>> log = DeviceLog()
        >>> device = RecordingDevice(0, log)
        >>> device.enter(); log.current
        'rec:0'
        >>> device.leave(); log.events, log.errors()
        ([('enter', 'rec:0'), ('leave', 'rec:0')], [])
    """

    __slots__ = ("current", "events")

    def __init__(self) -> None:
        self.current: str | None = None
        self.events: list[tuple[str, str]] = []

    def errors(self) -> list[tuple[str, str]]:
        """The events that break strict enter/leave pairs (``nested enter``, ``bad leave``).

        Example:
            >>> log = DeviceLog()
            >>> RecordingDevice(1, log).leave()
            >>> log.errors()
            [('bad leave', 'rec:1')]
        """
        return [event for event in self.events if event[0] not in ("enter", "leave")]


class RecordingDevice(FakeDevice):
    """A device whose "current device" is process state, as CuPy's thread-local device is.

    ``enter``/``leave`` set ``log.current`` and append to ``log.events``, so a test can check
    that code in a replica always runs with its own device current, across every await.

    Args:
        index: the device's number; the name is ``rec:{index}`` unless ``name`` is given.
        log: the log shared by the devices of one strategy.
        name: the device name.
        inline: as for ``FakeDevice``.

    Raises:
        TypeError: ``log`` is not a ``DeviceLog``; the other arguments as for ``FakeDevice``.
        ValueError: as for ``FakeDevice``.

    Example:
        >>> log = DeviceLog()
        >>> strategy = aioreplica.MirroredStrategy([RecordingDevice(i, log) for i in range(2)])
        >>> async def step():
        ...     return log.current
        >>> anyio.run(strategy.run, step)
        PerReplica({0: 'rec:0', 1: 'rec:1'})
        >>> log.current is None, log.errors()
        (True, [])
    """

    def __init__(
        self, index: int, log: DeviceLog, *, name: str | None = None, inline: bool = False
    ) -> None:
        if not isinstance(log, DeviceLog):
            raise TypeError(
                f"RecordingDevice: log must be a DeviceLog (one shared by the devices of a "
                f"strategy: log = DeviceLog()), got {type(log).__name__} {log!r}"
            )
        super().__init__(f"rec:{index}" if name is None else name, index, inline=inline)
        self.log = log

    def enter(self) -> None:
        """Make this device current, logging a ``nested enter`` if another one is."""
        log = self.log
        if log.current is not None:
            log.events.append(("nested enter", self.name))
        log.current = self.name
        log.events.append(("enter", self.name))

    def leave(self) -> None:
        """Make no device current, logging a ``bad leave`` if this one was not."""
        log = self.log
        if log.current != self.name:
            log.events.append(("bad leave", self.name))
        log.current = None
        log.events.append(("leave", self.name))


# -- the strategy factory ----------------------------------------------------------------


@final
class StrategyFactory:
    """Makes the strategies of one test: the value of the ``strategy_factory`` fixture.

    Args:
        replicas: the replica count of ``factory()`` without ``n``.
        seed: the seed of an ``interleavings`` item: strategies default to
            ``interleave="random"`` with this seed. ``None`` leaves ``interleave`` at its
            default.

    Raises:
        TypeError: ``replicas`` is not an int (NumPy's integers are; a bool is not), or
            ``seed`` neither an int nor ``None``.
        ValueError: ``replicas`` is below 1 or above 65536 (as for ``host_devices``).

    Example:
        >>> make = StrategyFactory(4)
        >>> make().devices
        ('cpu:0', 'cpu:1', 'cpu:2', 'cpu:3')
        >>> make(2, sync_timeout=5.0).sync_timeout
        5.0
        >>> seeded = StrategyFactory(2, seed=3)()
        >>> seeded.interleave, seeded.seed
        ('random', 3)
        >>> make.made
        ((4, 'ordered', None), (2, 'ordered', None))
        >>> make.close()
    """

    __slots__ = ("_made", "_replicas", "_seed", "_strategies")

    def __init__(self, replicas: int = DEFAULT_REPLICAS, *, seed: int | None = None) -> None:
        self._replicas = _count(replicas, "replicas")
        if seed is not None and as_integer(seed) is None:
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__} {seed!r}")
        self._seed = seed
        self._made: list[tuple[int, str, int | None]] = []
        self._strategies: list[MirroredStrategy] = []

    @property
    def replicas(self) -> int:
        """The replica count of ``factory()`` without ``n``."""
        return self._replicas

    @property
    def seed(self) -> int | None:
        """The interleavings seed, or ``None``."""
        return self._seed

    @property
    def made(self) -> tuple[tuple[int, str, int | None], ...]:
        """``(replicas, interleave, seed)`` of each strategy made so far, in order."""
        return tuple(self._made)

    def __call__(
        self,
        n: int | None = None,
        *,
        devices: Sequence[str | Device] | None = None,
        **kwargs: Any,
    ) -> MirroredStrategy:
        """A ``MirroredStrategy`` over ``n`` host devices (``n=None``: the test's count).

        Args:
            n: the number of replicas; ``None`` means ``replicas``, or ``len(devices)``.
            devices: devices to use instead of host devices (``FakeDevice``s, say).
            **kwargs: passed on to ``MirroredStrategy``: ``interleave``, ``seed``,
                ``sync_timeout``, ``communication_options``, ...

        Returns:
            The new strategy.

        Raises:
            TypeError: ``n`` is not an int; or as ``MirroredStrategy``.
            ValueError: ``n`` is below 1 or above 65536, or differs from ``len(devices)``; or as
                ``MirroredStrategy`` (an ``interleave`` it does not know, say).

        Example:
            >>> make = StrategyFactory(2)
            >>> make(3).num_replicas_in_sync
            3
            >>> make(devices=[FakeDevice("fake:0")]).devices
            ('fake:0',)
        """
        if devices is not None:
            devices = list(devices)
            if n is not None and _count(n, "n") != len(devices):
                raise ValueError(
                    f"n={n} replicas asked for with {len(devices)} devices; pass one of them, "
                    "or as many devices as replicas"
                )
        else:
            devices = host_devices(_count(self._replicas if n is None else n, "n"))
        if self._seed is not None:
            kwargs.setdefault("interleave", "random")
            if kwargs["interleave"] == "random":
                kwargs.setdefault("seed", self._seed)
        strategy = MirroredStrategy(devices, **kwargs)
        self._made.append((strategy.num_replicas_in_sync, strategy.interleave, strategy.seed))
        self._strategies.append(strategy)
        return strategy

    def close(self) -> None:
        """Close every strategy this factory made (``MirroredStrategy.close()``); the
        ``strategy_factory`` fixture calls it at the test's teardown.

        A strategy whose ``run()`` is still in progress (a test stopped in the middle of one)
        is left open, to be released when it is collected. Calling it again is harmless.

        Raises:
            OSError: the file of a trace one of the strategies still recorded cannot be
                written; the other strategies are closed all the same.

        Example:
            >>> make = StrategyFactory(2)
            >>> strategy = make()
            >>> make.close()
            >>> strategy.closed
            True
        """
        failure: OSError | None = None
        for strategy in self._strategies:
            if strategy.statistics().runs_active:
                continue  # close() would refuse: its threads would stop under the run
            try:
                strategy.close()
            except OSError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def __repr__(self) -> str:
        return f"StrategyFactory(replicas={self._replicas}, seed={self._seed})"


# -- the plugin --------------------------------------------------------------------------

_FACTORY: Final = pytest.StashKey["StrategyFactory"]()
#: Per test (the node id of its definition): the replica counts it runs with when no marker
#: on one of its parameters says otherwise, and every count it was parametrized with.
_COUNTS: Final = pytest.StashKey[dict[str, tuple[tuple[int, ...], tuple[int, ...]]]]()
#: Why an item must fail at setup (a marker on a fixture's parameter it cannot honour).
_PROBLEM: Final = pytest.StashKey[str]()
#: What ``pytest.param(...)`` returns.
_PARAMETER_SET: Final = type(pytest.param())

_MARKERS: Final = (
    "replicas(*counts): run the test once per replica count, such as replicas(1, 2, 4); "
    "for tests that use the strategy_factory or replicas fixture (aioreplica)",
    "interleavings(n): run the test once per seed 0..n-1, strategies from strategy_factory "
    "using interleave='random' with that seed (aioreplica)",
)


def _replica_counts(text: str) -> tuple[int, ...]:
    """Parse ``--aioreplica-replicas``: positive integers separated by commas."""
    counts: list[int] = []
    for part in text.split(","):
        try:
            count = int(part.strip())
        except ValueError:
            count = 0
        if count < 1:
            raise argparse.ArgumentTypeError(
                f"expected replica counts such as 1,2,4 (positive integers separated by "
                f"commas), got {text!r}"
            )
        if count in counts:
            raise argparse.ArgumentTypeError(f"replica count {count} appears twice in {text!r}")
        counts.append(count)
    return tuple(counts)


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--aioreplica-replicas``."""
    group = parser.getgroup("aioreplica", "aioreplica: replica counts of tests")
    group.addoption(
        "--aioreplica-replicas",
        dest="aioreplica_replicas",
        type=_replica_counts,
        default=str(DEFAULT_REPLICAS),
        metavar="COUNTS",
        help=(
            "replica counts, such as 1,2,4, for tests that use the strategy_factory or "
            "replicas fixture and have no replicas marker (default: %(default)s)"
        ),
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``replicas`` and ``interleavings`` markers."""
    for line in _MARKERS:
        config.addinivalue_line("markers", line)


def _parametrized_names(definition: pytest.Function) -> set[str]:
    """The argument names the test's own ``parametrize`` markers give values to."""
    names: set[str] = set()
    for marker in definition.iter_markers("parametrize"):
        argnames = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
        if isinstance(argnames, str):
            argnames = argnames.split(",")
        names.update(str(name).strip() for name in argnames)
    return names


def _parameter_markers(definition: pytest.Function, name: str) -> list[pytest.Mark]:
    """The ``name`` markers on ``pytest.param`` values of the test's own ``parametrize``."""
    found: list[pytest.Mark] = []
    for marker in definition.iter_markers("parametrize"):
        values = marker.args[1] if len(marker.args) > 1 else marker.kwargs.get("argvalues", ())
        for value in values:
            if isinstance(value, _PARAMETER_SET):
                marks = [m if isinstance(m, pytest.Mark) else m.mark for m in value.marks]
                found += [mark for mark in marks if mark.name == name]
    return found


def _marker_problem(marker: pytest.Mark, test: str, usage: str, *, single: bool) -> str | None:
    """What is wrong with the marker's arguments (positive ints, one if ``single``, no
    repeats), or None."""
    where = f"@pytest.mark.{marker.name} on {test}"
    got = None
    if marker.kwargs:
        got = "keyword arguments " + ", ".join(f"{k}={v!r}" for k, v in marker.kwargs.items())
    elif not marker.args:
        got = "no arguments"
    elif single and len(marker.args) > 1:
        got = f"{len(marker.args)} arguments {marker.args!r}"
    else:
        got = next(
            (
                repr(value)
                for value in marker.args
                if not isinstance(value, int) or isinstance(value, bool) or value < 1
            ),
            None,
        )
    if got is not None:
        return f"{where} takes {usage}, got {got}"
    values: list[int] = list(marker.args)
    if len(set(values)) < len(values):
        twice = next(value for value in values if values.count(value) > 1)
        return f"{where}: replica count {twice} appears twice"
    return None


def _marker_ints(marker: pytest.Mark, test: str, usage: str, *, single: bool) -> list[int]:
    """The marker's arguments, checked: positive ints (one if ``single``), no repeats; a
    collection error otherwise."""
    problem = _marker_problem(marker, test, usage, single=single)
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    return list(marker.args)


_COUNTS_USAGE: Final = "replica counts, such as replicas(1, 2, 4)"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize the tests that use the fixtures over replica counts and seeds."""
    definition = metafunc.definition
    used = set(metafunc.fixturenames)
    own = {marker.name for marker in definition.own_markers}
    direct = _parametrized_names(definition)

    marker = definition.get_closest_marker("replicas")
    counts: Sequence[int] | None = None
    if marker is not None:
        counts = _marker_ints(marker, definition.name, _COUNTS_USAGE, single=False)
    on_parameters = _parameter_markers(definition, "replicas")
    if "replicas" not in used:
        if "replicas" in own or on_parameters:
            pytest.fail(
                f"@pytest.mark.replicas on {definition.name}"
                f"{' (on a parameter)' if 'replicas' not in own else ''}, which uses neither "
                "the strategy_factory nor the replicas fixture: the marker would do nothing",
                pytrace=False,
            )
    elif "replicas" in direct:
        if "replicas" in own:
            pytest.fail(
                f"{definition.name} parametrizes replicas itself and has "
                "@pytest.mark.replicas; keep one of them",
                pytrace=False,
            )
    else:
        if counts is None:
            counts = metafunc.config.getoption("aioreplica_replicas")
        every = list(counts)
        for parameter_marker in on_parameters:  # their counts too: their items are kept
            wanted = _marker_ints(parameter_marker, definition.name, _COUNTS_USAGE, single=False)
            every += [count for count in wanted if count not in every]
        metafunc.config.stash.setdefault(_COUNTS, {})[definition.nodeid] = (
            tuple(counts),
            tuple(every),
        )
        metafunc.parametrize("replicas", every, indirect=True, ids=[f"replicas={n}" for n in every])

    marker = definition.get_closest_marker("interleavings")
    if marker is None:
        return
    (seeds,) = _marker_ints(
        marker, definition.name, "one number of seeds, such as interleavings(10)", single=True
    )
    if "interleave_seed" not in used:
        if "interleavings" in own:
            pytest.fail(
                f"@pytest.mark.interleavings on {definition.name}, which uses neither the "
                "strategy_factory nor the interleave_seed fixture: the marker would do nothing",
                pytrace=False,
            )
        return
    if "interleave_seed" in direct:
        pytest.fail(
            f"{definition.name} parametrizes interleave_seed itself and has "
            "@pytest.mark.interleavings; keep one of them",
            pytrace=False,
        )
    metafunc.parametrize(
        "interleave_seed",
        range(seeds),
        indirect=True,
        ids=[f"seed={seed}" for seed in range(seeds)],
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep each item whose replica count its parameters' ``replicas`` marker (else the
    test's counts) names; deselect the others."""
    tests = config.stash.get(_COUNTS, None)
    if not tests:
        return
    kept: list[pytest.Item] = []
    deselected: list[pytest.Item] = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        test = item.nodeid[: len(item.nodeid) - len(item.name)] + getattr(
            item, "originalname", item.name
        )
        if callspec is None or test not in tests or "replicas" not in callspec.params:
            kept.append(item)
            continue
        counts, every = tests[test]
        count = callspec.params["replicas"]
        markers = [getattr(mark, "mark", mark) for mark in callspec.marks]
        marker = next((mark for mark in markers if mark.name == "replicas"), None)
        if marker is None:
            (kept if count in counts else deselected).append(item)
            continue
        # A fixture's parameter: its marker was not seen when the test was parametrized.
        where = f"{getattr(item, 'originalname', item.name)} (on a parameter)"
        problem = _marker_problem(marker, where, _COUNTS_USAGE, single=False)
        if problem is None:
            wanted = list(marker.args)
            if count in wanted:
                kept.append(item)
                continue
            missing = [n for n in wanted if n not in every]
            if not missing:
                deselected.append(item)
                continue
            problem = (
                f"@pytest.mark.replicas({', '.join(map(str, wanted))}) on a parameter of "
                f"{getattr(item, 'originalname', item.name)}: the test "
                f"does not run with replica count{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))} (it runs with {', '.join(map(str, every))}); "
                "a fixture's parameter can only pick among those: put the counts on the test "
                "(@pytest.mark.replicas) or on a pytest.param of its own parametrize"
            )
        item.stash[_PROBLEM] = problem
        kept.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@pytest.fixture
def replicas(request: pytest.FixtureRequest) -> int:
    """The test's replica count (from the ``replicas`` marker or ``--aioreplica-replicas``)."""
    problem = request.node.stash.get(_PROBLEM, None)
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    count: int = getattr(request, "param", DEFAULT_REPLICAS)
    return count


@pytest.fixture
def interleave_seed(request: pytest.FixtureRequest) -> int | None:
    """The seed of an ``interleavings`` item, else ``None``."""
    seed: int | None = getattr(request, "param", None)
    return seed


@pytest.fixture
def strategy_factory(
    request: pytest.FixtureRequest, replicas: int, interleave_seed: int | None
) -> Generator[StrategyFactory, None, None]:
    """A ``StrategyFactory`` for the test's replica count and interleavings seed; the
    strategies it made are closed at the test's teardown."""
    factory = StrategyFactory(replicas, seed=interleave_seed)
    request.node.stash[_FACTORY] = factory
    yield factory
    factory.close()


def _report_lines(item: pytest.Item) -> list[str]:
    """What a failure report says about the test's strategies and seed."""
    lines: list[str] = []
    callspec = getattr(item, "callspec", None)
    params: dict[str, Any] = callspec.params if callspec is not None else {}
    if params.get("interleave_seed") is not None:
        lines.append(
            f"@pytest.mark.interleavings item with seed={params['interleave_seed']}: its "
            "strategies from strategy_factory default to that seed"
        )
    factory = item.stash.get(_FACTORY, None)
    for number, (count, interleave, seed) in enumerate(factory.made if factory else (), 1):
        made = f"strategy {number} from strategy_factory: {count} replicas, {interleave=}"
        if seed is not None:
            made += f", {seed=} (replay: MirroredStrategy(..., interleave='random', {seed=}))"
        lines.append(made)
    return lines


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Add an ``aioreplica`` section, naming the seed and the strategies, to a failure."""
    report = yield
    if report.failed and (lines := _report_lines(item)):
        report.sections.append(("aioreplica", "\n".join(lines)))
    return report
