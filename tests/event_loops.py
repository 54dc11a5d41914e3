"""The event loops of this suite's ``anyio`` tests, for tests that must leave one out."""

from __future__ import annotations

import pytest

#: Runs an ``anyio``-marked test on asyncio and uvloop only (the root ``conftest.py`` adds
#: trio), for behaviour trio cannot have (a ``CancelledError`` raised by hand,
#: ``asyncio``-specific ordering).
ASYNCIO_ONLY = pytest.mark.parametrize(
    "anyio_backend",
    [
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ],
)
