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
examples are reported as skipped, with the reason, where CuPy or a GPU is missing.
"""

from __future__ import annotations

import ast
import doctest
import functools
import importlib
import importlib.util
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


class _Skipped(pytest.File):
    """A module whose doctests are all skipped, for one reason."""

    reason: str

    def collect(self) -> list[pytest.Item]:
        pytest.skip(self.reason)


def _no_gpu() -> str | None:
    """Why the CuPy backend's examples cannot run here (they need CuPy and a GPU), or ``None``."""
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed: the CuPy backend's doctests need it"
    try:
        import cupy

        count = int(cupy.cuda.runtime.getDeviceCount())
    except (RuntimeError, OSError, ImportError) as exc:  # no driver, or no CUDA libraries
        return f"CuPy sees no CUDA device ({exc}): the CuPy backend's doctests need one"
    return None if count else "CuPy sees no CUDA device: the CuPy backend's doctests need one"


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(
    file_path: Path, parent: pytest.Collector
) -> Generator[None, list[pytest.Collector], list[pytest.Collector]]:
    """Skip the CuPy backend's module, with the reason, where CuPy or a GPU is missing."""
    collectors = yield
    if file_path == _CUPY_MODULE and collectors and (reason := _no_gpu()) is not None:
        skipped = _Skipped.from_parent(parent, path=file_path)
        skipped.reason = reason
        return [skipped]
    return collectors


#: The CuPy stand-in is a package named ``cupy`` for tests to put on the path, not test code.
collect_ignore = ["tests/cupy_sim"]

#: Its fixtures (``cp``, ``cb``) and the check that fails a test on a race it swallowed.
pytest_plugins = ["simulated_gpus"]
