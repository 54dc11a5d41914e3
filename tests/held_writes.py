"""Holding a checkpoint's array writes mid-save, shared by the checkpoint tests."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pytest


def hold_writes(monkeypatch: pytest.MonkeyPatch, until: threading.Event) -> threading.Event:
    """Make every array write wait (in its worker thread) for ``until``; return "writing",
    set once a write has begun."""
    writing = threading.Event()
    real = np.lib.format.write_array

    def held(*args: Any, **kwargs: Any) -> None:
        writing.set()
        assert until.wait(10), "the test never let the write go on"
        real(*args, **kwargs)

    monkeypatch.setattr(np.lib.format, "write_array", held)
    return writing
