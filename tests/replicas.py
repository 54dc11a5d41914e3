"""Small helpers shared by the tests that run replicas."""

from __future__ import annotations

import pytest

import aioreplica

#: Runs an ``anyio``-marked test on asyncio and uvloop only, for behaviour trio cannot have
#: (a ``CancelledError`` raised by hand, ``asyncio``-specific ordering).
ASYNCIO_ONLY = pytest.mark.parametrize(
    "anyio_backend",
    [
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ],
)


def cpus(n: int) -> list[str]:
    """The names of ``n`` logical host devices, ``cpu:0`` to ``cpu:{n-1}``."""
    return [f"cpu:{i}" for i in range(n)]


def ctx() -> aioreplica.ReplicaContext:
    """The current replica's context (the test fails if there is none)."""
    context = aioreplica.get_replica_context()
    assert context is not None
    return context


def rid() -> int:
    """The current replica's id."""
    return ctx().replica_id_in_sync_group
