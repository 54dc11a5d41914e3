"""The examples run, and do what they say."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

if TYPE_CHECKING:
    from types import ModuleType

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class TestQuickstart:
    @pytest.mark.anyio
    async def test_recovers_the_true_weights(self) -> None:
        """Data-parallel training on 4 replicas finds the weights that made the data."""
        quickstart = load("quickstart")
        result = await quickstart.main(replicas=4, steps=60, rows=512, report=False)
        np.testing.assert_allclose(result.weights, quickstart.TRUE_WEIGHTS, atol=0.01)
        assert result.merges == 60

    @pytest.mark.anyio
    async def test_replica_count_does_not_change_the_result(self) -> None:
        """Averaging equal-sized shard gradients gives the same weights on 1 or 8 replicas."""
        quickstart = load("quickstart")
        one = await quickstart.main(replicas=1, steps=20, rows=512, report=False)
        eight = await quickstart.main(replicas=8, steps=20, rows=512, report=False)
        np.testing.assert_allclose(one.weights, eight.weights, rtol=1e-12, atol=1e-12)

    def test_runs_from_the_command_line(self) -> None:
        """`python examples/quickstart.py` prints its progress and the true weights."""
        completed = subprocess.run(
            [sys.executable, str(EXAMPLES / "quickstart.py"), "--steps", "3", "--loop", "trio"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert "step    0" in completed.stdout
        assert "4 replicas, 3 merge rounds" in completed.stdout
