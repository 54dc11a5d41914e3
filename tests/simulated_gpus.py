"""Put the CuPy stand-in (``tests/cupy_sim``) in place of ``cupy`` for a block of tests.

``simulated_cupy(devices=4)`` imports a fresh stand-in with that many GPUs as ``cupy`` (and a
fresh ``aioreplica._backends._cupy`` on top of it), and on exit removes both again, so the
rest of the suite sees whatever CuPy the machine really has (usually none). A data race the
stand-in detected fails the block even if the code under test swallowed the ``RaceError``.

Also a pytest plugin (the root ``conftest.py`` loads it): the fixtures ``cp`` (the stand-in
with two GPUs, for one test) and ``cb`` (the CUDA backend imported on it), and a check after
every test that fails it on a race it did not raise.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import Generator, Iterator
    from types import ModuleType

SIM_DIR = Path(__file__).parent / "cupy_sim"

_OWNED = ("cupy", "cupyx", "aioreplica._backends._cupy")


def _drop_modules() -> dict[str, ModuleType]:
    dropped = {
        name: module
        for name, module in list(sys.modules.items())
        if any(name == owned or name.startswith(owned + ".") for owned in _OWNED)
    }
    for name in dropped:
        del sys.modules[name]
    backends = sys.modules.get("aioreplica._backends")
    if backends is not None and "_cupy" in vars(backends):
        delattr(backends, "_cupy")
    return dropped


@contextlib.contextmanager
def simulated_cupy(devices: int = 2, *, nccl: bool = True) -> Iterator[ModuleType]:
    """``cupy`` is the stand-in with ``devices`` GPUs inside the block (NCCL if ``nccl``)."""
    saved_env = {key: os.environ.get(key) for key in ("CUPY_SIM_DEVICES", "CUPY_SIM_NCCL")}
    saved_modules = _drop_modules()
    os.environ["CUPY_SIM_DEVICES"] = str(devices)
    os.environ["CUPY_SIM_NCCL"] = "1" if nccl else "0"
    sys.path.insert(0, str(SIM_DIR))
    try:
        cupy = importlib.import_module("cupy")
        assert cupy.__file__ is not None
        assert Path(cupy.__file__).is_relative_to(SIM_DIR)
        try:
            yield cupy
        finally:
            cupy._sim.close()
        races = cupy._sim.world().races
        assert not races, "data races:\n" + "\n".join(races)
    finally:
        sys.path.remove(str(SIM_DIR))
        _drop_modules()
        sys.modules.update(saved_modules)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def races(cupy: Any) -> list[str]:
    """The races the stand-in has recorded so far (and forget them)."""
    world = cupy._sim.world()
    found = list(world.races)
    world.races.clear()
    return found


@pytest.fixture
def cp() -> Iterator[ModuleType]:
    """The stand-in as ``cupy``: a fresh machine with two GPUs and NCCL, for one test."""
    with simulated_cupy(2) as cupy:
        yield cupy


@pytest.fixture
def cb(cp: ModuleType) -> ModuleType:
    """``aioreplica._backends._cupy``, imported on the stand-in of ``cp``."""
    from aioreplica._backends import _cupy

    return _cupy


_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[_FAILED] = report.failed
    return report


@pytest.fixture(autouse=True)
def _no_unreported_races(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test after which the stand-in holds a race the test did not fail on (one that
    the code under test caught and dropped); forget the races of a test that failed."""
    yield
    cupy = sys.modules.get("cupy")
    sim = getattr(cupy, "_sim", None)
    if sim is None:
        return
    races = sim.world().races
    found = list(races)
    races.clear()
    if found and not request.node.stash.get(_FAILED, False):
        pytest.fail("data races the test did not raise:\n" + "\n".join(found), pytrace=False)
