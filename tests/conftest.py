"""Shared test configuration.

Backend-agnostic tests are marked ``pytest.mark.anyio`` and run on every event loop listed in
``anyio_backend``: asyncio, asyncio with uvloop, and trio. A missing loop fails loudly rather
than skipping. Asyncio-only tests use ``pytest.mark.asyncio`` (pytest-asyncio, strict mode).
"""

from __future__ import annotations

import sys

import pytest

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
