"""Shared test configuration: event loops for the suite, names and collection for doctests.

Backend-agnostic tests are marked ``pytest.mark.anyio`` and run on every event loop listed in
``anyio_backend``: asyncio, asyncio with uvloop, and trio. A missing loop fails loudly rather
than skipping. Asyncio-only tests use ``pytest.mark.asyncio`` (pytest-asyncio, strict mode).

Docstring examples run too (``--doctest-modules``, see pyproject).
Every docstring example sees ``np``, ``anyio`` and ``aioreplica`` without importing them, and
``tmp``, a fresh directory (the example's ``tmp_path``) for files it writes.

A docstring's examples are collected from the file that defines it. ``aioreplica/__init__.py``
renames its exports' ``__module__`` to ``aioreplica``, which doctest's own rule (the object's
``__module__``) would take for the package: their methods would never run. The CuPy backend's
examples run in tests/backends/test_cupy.py (on the stand-in) and test_cupy_gpu.py (on a GPU).
"""

from __future__ import annotations

import ast
import doctest
import functools
import importlib
import inspect
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

if TYPE_CHECKING:
    from collections.abc import Generator
    from types import ModuleType

_PACKAGE = Path(__file__).parent / "aioreplica"
_CUPY_MODULE = _PACKAGE / "_backends" / "_cupy.py"
_doctest_from_module = doctest.DocTestFinder._from_module  # type: ignore[attr-defined]

_BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("trio", {}), id="trio"),
]
if sys.platform != "win32":
    _BACKENDS.insert(1, pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"))


@pytest.fixture(params=_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    """Run each anyio test on asyncio, uvloop and trio."""
    backend: tuple[str, dict[str, object]] = request.param
    return backend


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict[str, Any], request: pytest.FixtureRequest) -> None:
    """Fill the namespace of docstring examples; a no-op for ordinary tests."""
    if isinstance(request.node, pytest.DoctestItem):
        doctest_namespace.update(
            np=np,
            anyio=anyio,
            aioreplica=importlib.import_module("aioreplica"),
            tmp=request.getfixturevalue("tmp_path"),
        )


@functools.cache
def _class_names(file: str) -> frozenset[str]:
    """The qualified names of the classes that ``file`` defines."""
    names: set[str] = set()

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for stmt in body:
            if isinstance(stmt, ast.ClassDef):
                names.add(prefix + stmt.name)
                visit(stmt.body, f"{prefix}{stmt.name}.")

    visit(ast.parse(Path(file).read_text(encoding="utf-8")).body, "")
    return frozenset(names)


def _defined_in_file(finder: doctest.DocTestFinder, module: ModuleType | None, obj: Any) -> bool:
    """``DocTestFinder._from_module`` by the file that defines ``obj``, not its ``__module__``."""
    file = getattr(module, "__file__", None)
    target = obj.fget if isinstance(obj, property) else obj
    target = target.func if isinstance(target, functools.cached_property) else target
    code = getattr(inspect.unwrap(target), "__code__", None) if callable(target) else None
    if file is not None and code is not None:
        return bool(code.co_filename == file)
    if file is not None and inspect.isclass(obj):
        return obj.__qualname__ in _class_names(file)
    return bool(_doctest_from_module(finder, module, obj))


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """Collect the package's doctests by defining file (see the module docstring)."""
    if collector.path.suffix != ".py" or _PACKAGE not in collector.path.parents:
        return (yield)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(doctest.DocTestFinder, "_from_module", _defined_in_file)
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(
    file_path: Path, parent: pytest.Collector
) -> Generator[None, list[pytest.Collector], list[pytest.Collector]]:
    """Leave the CuPy backend's examples to the tests that run them: on the CuPy stand-in
    (tests/backends/test_cupy.py) and on a real GPU (tests/backends/test_cupy_gpu.py, skipped
    with the rest of the GPU-only tests, on one line, where there is none)."""
    collectors = yield
    return [] if file_path == _CUPY_MODULE else collectors


#: The CuPy stand-in is a package named ``cupy`` for tests to put on the path, not test code.
collect_ignore = ["tests/cupy_sim"]

#: Its fixtures (``cp``, ``cb``) and the check that fails a test on a race it swallowed; and
#: pytest's ``pytester`` fixture, which tests/test_testing_plugin.py runs the plugin with.
pytest_plugins = ["simulated_gpus", "pytester"]
