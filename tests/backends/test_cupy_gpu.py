"""The CUDA backend's tests of ``test_cupy.py``, and its docstring examples, on the real CuPy.

``test_cupy.py`` runs these classes and the examples on the CuPy stand-in, which checks the
order of device work but not CUDA itself; here the same tests run on the machine's GPUs.
Where CuPy is missing or sees no CUDA device, the whole module is skipped at collection, so
``pytest -ra`` reports every GPU-only test on one line with the reason.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import pytest


def _no_cuda_device() -> str | None:
    """Why the GPU tests cannot run here, or ``None`` when CuPy sees a CUDA device."""
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install 'aioreplica[cuda]' on a machine with a GPU)"
    try:
        import cupy

        count = int(cupy.cuda.runtime.getDeviceCount())
    except (RuntimeError, OSError, ImportError) as exc:  # no driver, or no CUDA libraries
        return f"CuPy is installed but cannot reach a CUDA device ({exc})"
    return None if count else "CuPy is installed but sees no CUDA device"


if (_reason := _no_cuda_device()) is not None:
    pytest.skip(
        f"the GPU-only tests need CuPy and a CUDA device: {_reason}", allow_module_level=True
    )

# Collected again here, with the real backend as ``cb``.
from test_cupy import TestCudaDevice as TestCudaDevice  # noqa: E402
from test_cupy import TestCupyBackend as TestCupyBackend  # noqa: E402
from test_cupy import assert_docstring_examples_pass  # noqa: E402
from test_cupy import cp as cp  # noqa: E402

if TYPE_CHECKING:
    from types import ModuleType


@pytest.fixture(scope="module")
def cb() -> ModuleType:
    """The ``_cupy`` backend module on the real CuPy."""
    from aioreplica._backends import _cupy

    return _cupy


def test_docstring_examples_run_on_the_gpu(cb: ModuleType) -> None:
    """The CUDA backend's docstring examples pass on the real CuPy."""
    assert_docstring_examples_pass(cb)
