"""Tests for the command line, ``python -m aioreplica`` (``aioreplica/_cli.py``).

``info`` runs in a child process, with the CuPy stand-in (``tests/cupy_sim``) or small fake
``cupy`` / ``mpi4py`` packages put first on its ``PYTHONPATH`` where a test needs them, so the
installation each test describes is the child's alone. ``trace-summary`` reads trace files
written here by hand, in the format ``strategy.trace(...)`` writes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import trio

import aioreplica
from aioreplica._cli import main

SIM_DIR = Path(__file__).parent / "cupy_sim"
REPO = Path(__file__).parent.parent

CUPY_INSTALLED = importlib.util.find_spec("cupy") is not None

INSTALL_CUPY = "pip install 'aioreplica[cuda]'"

#: A ``sitecustomize`` under which mpi4py cannot be found, as if it were not installed.
_HIDE_MPI4PY = """\
import sys
from importlib.machinery import PathFinder


class _WithoutMpi4py(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] == "mpi4py":
            return None
        return super().find_spec(name, path, target)


sys.meta_path[:] = [_WithoutMpi4py if f is PathFinder else f for f in sys.meta_path]
"""
INSTALL_MPI = "pip install 'aioreplica[mpi]'"


def _cli(
    *args: str, path: tuple[Path, ...] = (), env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m aioreplica *args`` with ``path`` first on ``PYTHONPATH``.

    Warnings are errors in the child (``-W error``): a warning that ``info`` let escape while
    importing an optional module would fail the command.
    """
    child_env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "CUPY_SIM_DEVICES", "CUPY_SIM_NCCL")
    }
    child_env.update(env or {})
    if path:
        child_env["PYTHONPATH"] = os.pathsep.join(str(entry) for entry in path)
    return subprocess.run(
        [sys.executable, "-W", "error", "-m", "aioreplica", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env=child_env,
        cwd=REPO,
    )


def _info(path: tuple[Path, ...] = (), env: dict[str, str] | None = None) -> dict[str, Any]:
    completed = _cli("info", "--json", path=path, env=env)
    assert (completed.returncode, completed.stderr) == (0, "")
    info: dict[str, Any] = json.loads(completed.stdout)
    return info


def _simulated(devices: int, nccl: bool = True) -> dict[str, Any]:
    """``info --json`` with the CuPy stand-in and ``devices`` simulated GPUs."""
    env = {"CUPY_SIM_DEVICES": str(devices), "CUPY_SIM_NCCL": "1" if nccl else "0"}
    return _info(path=(SIM_DIR,), env=env)


def _table(text: str) -> dict[str, str]:
    """The first block of ``info``'s text as label -> value, checking that it is aligned:
    every value starts in the same column, two or more blanks after the longest label."""
    block = text.split("\n\n")[0].splitlines()
    column = len(block[0]) - len(block[0].split("  ")[-1].lstrip())
    rows: dict[str, str] = {}
    label = ""
    for line in block:
        assert line[column - 2 : column] == "  ", line
        assert not line[column].isspace(), line
        if line[:column].strip():
            label = line[:column].strip()
            rows[label] = line[column:]
        else:  # a value of several lines
            rows[label] += "\n" + line[column:]
    return rows


def _fake_package(root: Path, name: str, files: dict[str, str]) -> Path:
    """Write a package ``name`` under ``root`` (file name -> source) and return ``root``."""
    package = root / name
    package.mkdir(parents=True)
    for file, source in files.items():
        (package / file).write_text(textwrap.dedent(source), encoding="utf-8")
    return root


MPI4PY_INIT = """\
__version__ = "4.1.2"


class rc:
    initialize = True
    finalize = None
"""

#: Loads only if MPI would not be initialised, as mpi4py's MPI module initialises it on import.
WORKING_MPI = """\
import mpi4py

if mpi4py.rc.initialize:
    raise RuntimeError("MPI_Init would run: info must not initialise MPI")


def Get_library_version():
    return "MPICH Version:      5.0.2\\nMPICH Release date: today\\n"


def Get_version():
    return (4, 1)
"""


class TestInfo:
    @pytest.mark.timeout(60)
    def test_json_keys_and_versions(self) -> None:
        """``--json`` prints one object with the documented keys; each version is the one the
        running interpreter has."""
        info = _info()
        assert sorted(info) == [
            "aioreplica",
            "backends",
            "cuda",
            "devices",
            "gpus",
            "missing",
            "mpi",
            "nccl",
            "packages",
            "platform",
            "python",
        ]
        assert info["aioreplica"] == aioreplica.__version__
        assert info["python"] == {
            "version": platform.python_version(),
            "full": sys.version,
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        }
        assert info["platform"] == platform.platform()
        packages = info["packages"]
        assert list(packages) == ["numpy", "anyio", "trio", "uvloop", "cupy", "mpi4py"]
        assert packages["numpy"] == {
            "installed": True,
            "version": np.__version__,
            "error": None,
            "warnings": [],
        }
        assert packages["anyio"]["version"] == importlib.metadata.version("anyio")
        assert packages["trio"]["version"] == trio.__version__
        assert sorted(info["backends"]) == ["gpu", "host", "multi_worker", "nccl"]
        assert info["backends"]["host"] == {"ready": True, "missing": []}
        assert info["devices"] == aioreplica.list_devices()

    @pytest.mark.skipif(CUPY_INSTALLED, reason="CuPy is installed here")
    @pytest.mark.timeout(60)
    def test_without_cupy_says_how_to_install_it(self) -> None:
        """Without CuPy: the host device only, and the GPU backend says what to install."""
        info = _info()
        assert info["packages"]["cupy"] == {
            "installed": False,
            "version": None,
            "error": None,
            "warnings": [],
        }
        assert info["devices"] == ["cpu:0"]
        assert info["gpus"] == []
        assert info["cuda"] == {"runtime": None, "driver": None, "error": "CuPy is not installed"}
        assert info["nccl"] == {
            "available": False,
            "version": None,
            "error": "CuPy is not installed",
        }
        assert info["backends"]["gpu"] == {
            "ready": False,
            "missing": [f"CuPy is not installed: {INSTALL_CUPY}"],
        }
        assert info["backends"]["nccl"] == {
            "ready": False,
            "missing": ["needs the GPU backend (see GPU)"],
        }
        assert info["missing"][:2] == [
            f"GPU: CuPy is not installed: {INSTALL_CUPY}",
            "NCCL: needs the GPU backend (see GPU)",
        ]

    @pytest.mark.timeout(60)
    def test_without_mpi4py_says_how_to_install_it(self, tmp_path: Path) -> None:
        """Without mpi4py the multi-worker backend says what to install (mpi4py, which the test
        extra installs, is hidden from the child by a ``sitecustomize`` on its path)."""
        (tmp_path / "sitecustomize.py").write_text(_HIDE_MPI4PY)
        info = _info(path=(tmp_path,))
        assert info["packages"]["mpi4py"]["installed"] is False
        assert info["mpi"] == {
            "library": None,
            "standard": None,
            "error": "mpi4py is not installed",
        }
        assert info["backends"]["multi_worker"] == {
            "ready": False,
            "missing": [f"mpi4py is not installed: {INSTALL_MPI}"],
        }
        assert info["missing"][-1] == f"multi-worker: mpi4py is not installed: {INSTALL_MPI}"

    @pytest.mark.skipif(CUPY_INSTALLED, reason="CuPy is installed here")
    @pytest.mark.timeout(60)
    def test_text_without_cupy(self) -> None:
        """The text form: aligned rows of facts, then what is ready and what is missing."""
        completed = _cli("info")
        assert (completed.returncode, completed.stderr) == (0, "")
        rows = _table(completed.stdout)
        assert rows["aioreplica"] == aioreplica.__version__
        assert rows["NumPy"] == np.__version__
        assert rows["trio"] == trio.__version__
        assert rows["CuPy"] == "not installed"
        assert (rows["CUDA runtime"], rows["CUDA driver"], rows["NCCL"]) == ("-", "-", "-")
        assert rows["devices"] == "cpu:0"
        lines = completed.stdout.splitlines()
        missing = lines[lines.index("missing") + 1 :]
        assert missing[:2] == [
            f"  GPU: CuPy is not installed: {INSTALL_CUPY}",
            "  NCCL: needs the GPU backend (see GPU)",
        ]

    @pytest.mark.timeout(60)
    def test_simulated_gpus(self) -> None:
        """With the CuPy stand-in and two GPUs: both listed with their properties, CuPy's,
        CUDA's and NCCL's versions, and the GPU and NCCL backends ready."""
        info = _simulated(devices=2)
        assert info["devices"] == ["gpu:0", "gpu:1", "cpu:0"]
        assert info["packages"]["cupy"] == {
            "installed": True,
            "version": "14.0.0+sim",
            "error": None,
            "warnings": [],
        }
        assert info["cuda"] == {"runtime": "13.0", "driver": "13.0", "error": None}
        assert info["nccl"] == {"available": True, "version": "2.20.0", "error": None}
        assert info["gpus"] == [
            {
                "device": f"gpu:{index}",
                "name": "Simulated GPU (cupy_sim)",
                "memory_bytes": 1 << 34,
                "compute_capability": "9.0",
                "error": None,
            }
            for index in range(2)
        ]
        assert info["backends"]["gpu"] == {"ready": True, "missing": []}
        assert info["backends"]["nccl"] == {"ready": True, "missing": []}
        assert not any(line.startswith(("GPU", "NCCL")) for line in info["missing"])

    @pytest.mark.timeout(60)
    def test_simulated_gpus_text(self) -> None:
        """The text form lists the GPUs, one row each, and NCCL's version."""
        completed = _cli("info", path=(SIM_DIR,), env={"CUPY_SIM_DEVICES": "2"})
        assert (completed.returncode, completed.stderr) == (0, "")
        rows = _table(completed.stdout)
        assert rows["CuPy"] == "14.0.0+sim"
        assert (rows["CUDA runtime"], rows["CUDA driver"], rows["NCCL"]) == (
            "13.0",
            "13.0",
            "2.20.0",
        )
        assert rows["devices"] == "gpu:0, gpu:1, cpu:0"
        gpu = "Simulated GPU (cupy_sim), 16.0 GiB, compute capability 9.0"
        assert (rows["gpu:0"], rows["gpu:1"]) == (gpu, gpu)
        ready = [line for line in completed.stdout.splitlines() if line.startswith("ready")]
        assert ready[0].split(None, 1)[1].startswith("host, GPU, NCCL")

    @pytest.mark.timeout(60)
    def test_nccl_missing(self) -> None:
        """CuPy without NCCL: the GPU backend is ready, NCCL is missing with CuPy's own warning
        as the cause (caught, not raised: the child runs with ``-W error``) and the fix."""
        info = _simulated(devices=2, nccl=False)
        warning = "UserWarning: NCCL library could not be loaded (cupy_sim: CUPY_SIM_NCCL=0)"
        assert info["nccl"] == {"available": False, "version": None, "error": warning}
        assert info["backends"]["gpu"] == {"ready": True, "missing": []}
        assert info["backends"]["nccl"] == {
            "ready": False,
            "missing": [
                f"CuPy cannot load NCCL, which several GPUs in one process need ({warning}): "
                "pip install nvidia-nccl-cu13, or python -m cupyx.tools.install_library "
                "--library nccl --cuda 13.x"
            ],
        }
        assert info["missing"][0].startswith("NCCL: CuPy cannot load NCCL")

    @pytest.mark.timeout(60)
    def test_cupy_without_a_device(self) -> None:
        """CuPy that sees no GPU: the host device only, and the GPU backend says so."""
        info = _simulated(devices=0)
        assert info["devices"] == ["cpu:0"]
        assert info["gpus"] == []
        assert info["backends"]["gpu"] == {
            "ready": False,
            "missing": [
                "CuPy found no CUDA device: check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
            ],
        }
        assert info["missing"][0].startswith("GPU: CuPy found no CUDA device")

    @pytest.mark.timeout(60)
    def test_broken_cupy_is_reported_not_raised(self, tmp_path: Path) -> None:
        """A CuPy that fails to import (its CUDA libraries missing): ``info`` still succeeds,
        lists the host device, and reports the import error with the fix."""
        error = "libcudart.so.12: cannot open shared object file: No such file or directory"
        root = _fake_package(tmp_path, "cupy", {"__init__.py": f"raise ImportError({error!r})\n"})
        info = _info(path=(root,))
        assert info["packages"]["cupy"] == {
            "installed": True,
            "version": None,
            "error": f"ImportError: {error}",
            "warnings": [],
        }
        assert info["devices"] == ["cpu:0"]
        assert info["backends"]["gpu"] == {
            "ready": False,
            "missing": [
                f"CuPy is installed but does not import (ImportError: {error}): reinstall the "
                f"CuPy wheel that matches your CUDA ({INSTALL_CUPY} installs the one for CUDA 12)"
            ],
        }
        text = _cli("info", path=(root,))
        assert (text.returncode, text.stderr) == (0, "")
        assert _table(text.stdout)["CuPy"] == f"does not import: ImportError: {error}"

    @pytest.mark.timeout(60)
    def test_mpi_library_found_without_initialising_mpi(self, tmp_path: Path) -> None:
        """With mpi4py and an MPI library: their versions, and the multi-worker backend ready.
        The fake ``mpi4py.MPI`` refuses to load if MPI would be initialised."""
        root = _fake_package(
            tmp_path, "mpi4py", {"__init__.py": MPI4PY_INIT, "MPI.py": WORKING_MPI}
        )
        info = _info(path=(root,))
        assert info["packages"]["mpi4py"]["version"] == "4.1.2"
        assert info["mpi"] == {
            "library": "MPICH Version:      5.0.2\nMPICH Release date: today",
            "standard": "4.1",
            "error": None,
        }
        assert info["backends"]["multi_worker"] == {"ready": True, "missing": []}
        completed = _cli("info", path=(root,))
        assert completed.returncode == 0
        rows = _table(completed.stdout)
        assert (rows["mpi4py"], rows["MPI library"], rows["MPI standard"]) == (
            "4.1.2",
            "MPICH Version: 5.0.2",
            "4.1",
        )

    @pytest.mark.timeout(60)
    def test_mpi_library_missing(self, tmp_path: Path) -> None:
        """mpi4py that finds no MPI library: the error, every line of it, and the fix; in the
        text form the error's lines follow the fix, indented."""
        broken = (
            'raise RuntimeError("cannot load MPI library\\n'
            'libmpi.so: cannot open shared object file")\n'
        )
        root = _fake_package(tmp_path, "mpi4py", {"__init__.py": MPI4PY_INIT, "MPI.py": broken})
        info = _info(path=(root,))
        cause = "RuntimeError: cannot load MPI library\nlibmpi.so: cannot open shared object file"
        assert info["mpi"] == {"library": None, "standard": None, "error": cause}
        fix = (
            "install one (pip install mpich), or load your cluster's MPI so that mpi4py finds "
            "its libmpi"
        )
        assert info["backends"]["multi_worker"] == {
            "ready": False,
            "missing": [f"mpi4py cannot load an MPI library: {fix}\n{cause}"],
        }
        completed = _cli("info", path=(root,))
        assert completed.returncode == 0
        assert completed.stdout.endswith(
            f"  multi-worker: mpi4py cannot load an MPI library: {fix}\n"
            "    RuntimeError: cannot load MPI library\n"
            "    libmpi.so: cannot open shared object file\n"
        )

    @pytest.mark.timeout(60)
    def test_mpi_library_that_kills_the_process(self, tmp_path: Path) -> None:
        """An MPI library that ends the process as it loads ends only the probe's child
        process: ``info`` reports the exit status and the last thing it printed."""
        crash = "import os, sys\nsys.stderr.write('libmpi: fatal error\\n')\nos._exit(134)\n"
        root = _fake_package(tmp_path, "mpi4py", {"__init__.py": MPI4PY_INIT, "MPI.py": crash})
        info = _info(path=(root,))
        assert info["mpi"]["error"] == (
            "loading it ended the process (exit status 134): libmpi: fatal error"
        )
        assert info["backends"]["multi_worker"]["ready"] is False

    @pytest.mark.timeout(60)
    def test_mpi_library_that_crashes(self, tmp_path: Path) -> None:
        """An MPI library that crashes the interpreter (a signal): the signal is named."""
        crash = "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"
        root = _fake_package(tmp_path, "mpi4py", {"__init__.py": MPI4PY_INIT, "MPI.py": crash})
        info = _info(path=(root,))
        assert info["mpi"]["error"] == "loading it ended the process (killed by SIGSEGV)"

    @pytest.mark.timeout(60)
    def test_broken_mpi4py_is_reported(self, tmp_path: Path) -> None:
        """An mpi4py that fails to import is reported with its error."""
        root = _fake_package(tmp_path, "mpi4py", {"__init__.py": "import _mpi4py_gone\n"})
        info = _info(path=(root,))
        error = "ModuleNotFoundError: No module named '_mpi4py_gone'"
        assert info["packages"]["mpi4py"]["error"] == error
        assert info["backends"]["multi_worker"]["missing"] == [
            f"mpi4py is installed but does not import ({error}): reinstall it: {INSTALL_MPI}"
        ]

    @pytest.mark.timeout(60)
    def test_a_module_that_exits_as_it_imports_is_reported(self, tmp_path: Path) -> None:
        """A CuPy and an mpi4py that raise ``SystemExit`` as they import do not end ``info``:
        both are reported with their error, and the host device is listed."""
        source = {"__init__.py": "raise SystemExit('no CUDA here')\n"}
        root = _fake_package(tmp_path, "cupy", source)
        _fake_package(tmp_path, "mpi4py", source)
        info = _info(path=(root,))
        error = "SystemExit: no CUDA here"
        assert [info["packages"][name]["error"] for name in ("cupy", "mpi4py")] == [error, error]
        assert info["devices"] == ["cpu:0"]
        assert info["backends"]["gpu"]["missing"][0].startswith(
            f"CuPy is installed but does not import ({error})"
        )
        assert info["backends"]["multi_worker"]["missing"] == [
            f"mpi4py is installed but does not import ({error}): reinstall it: {INSTALL_MPI}"
        ]

    @pytest.mark.timeout(60)
    def test_a_cupy_without_cuda_and_noise_on_stdout(self, tmp_path: Path) -> None:
        """A ``cupy`` that is not CuPy (no ``cupy.cuda``) and prints as it imports: ``info``
        reports what is missing, and what the module printed goes to stderr, so that the JSON
        on stdout stays whole."""
        source = "import sys\nprint('hello from cupy')\n__version__ = '0.1'\n"
        root = _fake_package(tmp_path, "cupy", {"__init__.py": source})
        completed = _cli("info", "--json", path=(root,))
        assert (completed.returncode, completed.stderr) == (0, "hello from cupy\n")
        info = json.loads(completed.stdout)
        missing = "AttributeError: module 'cupy' has no attribute 'cuda'"
        assert info["cuda"] == {
            "runtime": None,
            "driver": None,
            "error": f"runtime: {missing}; driver: {missing}",
        }
        assert info["backends"]["gpu"]["missing"] == [
            f"CuPy found no CUDA device ({missing}): check the driver (nvidia-smi) and "
            "CUDA_VISIBLE_DEVICES"
        ]
        assert info["devices"] == ["cpu:0"]

    @pytest.mark.timeout(60)
    def test_optional_modules_load_only_when_the_command_runs(self, tmp_path: Path) -> None:
        """Importing the CLI (and ``aioreplica``) loads none of CuPy, trio, mpi4py, uvloop,
        though the stand-in CuPy and a fake mpi4py are on the path; ``info`` loads them."""
        root = _fake_package(
            tmp_path, "mpi4py", {"__init__.py": MPI4PY_INIT, "MPI.py": WORKING_MPI}
        )
        code = (
            "import json, sys\n"
            "import aioreplica._cli\n"
            "optional = ('cupy', 'trio', 'mpi4py', 'uvloop')\n"
            "def loaded():\n"
            "    return sorted(m for m in sys.modules if m.split('.')[0] in optional)\n"
            "before = loaded()\n"
            "aioreplica._cli.collect_info()\n"
            "print(json.dumps([before, sorted({m.split('.')[0] for m in loaded()})]))\n"
        )
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = os.pathsep.join([str(SIM_DIR), str(root)])
        completed = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
            env=env,
        )
        assert (completed.returncode, completed.stderr) == (0, "")
        before, after = json.loads(completed.stdout)
        assert before == []
        assert after == ["cupy", "mpi4py", "trio", "uvloop"]


class TestCommandLine:
    @pytest.mark.timeout(60)
    def test_help(self) -> None:
        """``--help`` prints the usage and both commands."""
        completed = _cli("--help")
        assert (completed.returncode, completed.stderr) == (0, "")
        assert completed.stdout.startswith("usage: python -m aioreplica [-h] [--version] COMMAND")
        assert "info" in completed.stdout
        assert "trace-summary" in completed.stdout

    @pytest.mark.timeout(60)
    def test_no_command_prints_the_help(self) -> None:
        """With no argument it prints the same help as ``--help``."""
        completed = _cli()
        assert (completed.returncode, completed.stderr) == (0, "")
        assert completed.stdout == _cli("--help").stdout

    @pytest.mark.timeout(60)
    def test_unknown_command(self) -> None:
        """An unknown command exits with status 2 and the usage."""
        completed = _cli("bogus")
        assert completed.returncode == 2
        assert completed.stdout == ""
        assert completed.stderr.startswith("usage: python -m aioreplica")
        assert "invalid choice: 'bogus'" in completed.stderr

    @pytest.mark.timeout(60)
    def test_version(self) -> None:
        """``--version`` prints the package's version."""
        completed = _cli("--version")
        assert (completed.returncode, completed.stdout) == (
            0,
            f"aioreplica {aioreplica.__version__}\n",
        )

    @pytest.mark.timeout(60)
    def test_a_closed_pipe_ends_it_quietly(self) -> None:
        """A reader that has gone (``... | head -1``): status 1 and no traceback. The pipe's
        read end is closed before the command starts, so its first write fails."""
        read, write = os.pipe()
        os.close(read)
        try:
            completed = subprocess.run(
                [sys.executable, "-m", "aioreplica", "info", "--json"],
                stdout=write,
                stderr=subprocess.PIPE,
                text=True,
                check=False,
                timeout=60,
                cwd=REPO,
            )
        finally:
            os.close(write)
        assert (completed.returncode, completed.stderr) == (1, "")

    def test_trace_summary_needs_a_path(self, capsys: pytest.CaptureFixture[str]) -> None:
        """``trace-summary`` without a file is a usage error (status 2)."""
        with pytest.raises(SystemExit) as exit_info:
            main(["trace-summary"])
        assert exit_info.value.code == 2
        assert "the following arguments are required: RUN.json" in capsys.readouterr().err


# -- trace-summary ---------------------------------------------------------------------------


def _meta(pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def _span(name: str, pid: int, tid: int, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _write(path: Path, events: list[dict[str, Any]]) -> Path:
    trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"replicas": 3}}
    path.write_text(json.dumps(trace), encoding="utf-8")
    return path


def _three_replicas() -> list[dict[str, Any]]:
    """Three replicas of worker 0 and a "main" track, over 2000 µs, in three merge rounds.

    Arrivals (merge wait starts): round 0: 100, 300, 200, so replica 1 is last; round 1:
    1000, 900, 1000, a tie of replicas 0 and 2, so replica 0; round 2: replica 1 again.
    """
    events = [
        _meta(0, 0, "replica 0"),
        _meta(0, 1, "replica 1"),
        _meta(0, 2, "replica 2"),
        _meta(0, 99, "main"),
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "worker 0"}},
        # The main track counts towards the traced time (0 to 2000 µs) only.
        _span("compute", 0, 99, 0, 50),
        _span("checkpoint save", 0, 99, 1500, 500),
        # A track without a "replica" name is not a replica, whatever its spans.
        _span("compute", 0, 7, 0, 1000),
        # Other spans on replica tracks do not count as compute or waiting.
        _span("merge_fn mean", 0, 0, 310, 20),
        _span("all_reduce", 0, 0, 312, 10, op="SUM", bytes=64, devices=["cpu:0"]),
        _span("device.run step", 0, 1, 10, 200),
    ]
    starts = {0: [100, 1000, 1600], 1: [300, 900, 1700], 2: [200, 1000, 1650]}
    for replica, waits in starts.items():
        previous_end = 0
        for merge_round, start in enumerate(waits):
            events.append(_span("compute", 0, replica, previous_end, start - previous_end))
            events.append(
                _span("merge wait", 0, replica, start, 10 * (replica + 1), round=merge_round)
            )
            previous_end = start + 10 * (replica + 1)
    return events


class TestTraceSummary:
    def test_totals_shares_and_the_last_replica(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Per replica track: compute and merge-wait totals, their shares of the traced time,
        and the replica that arrived last most often, ties going to the lowest id."""
        path = _write(tmp_path / "run.json", _three_replicas())
        assert main(["trace-summary", str(path), "--json"]) == 0
        out = capsys.readouterr()
        assert out.err == ""
        # compute: replica r waits 10 (r + 1) µs a round, so it computes up to each wait:
        # replica 0: 100 + (1000 - 110) + (1600 - 1010) = 1580; replica 1: 300 + 580 + 780
        # = 1660; replica 2: 200 + 770 + 620 = 1590.
        assert json.loads(out.out) == {
            "file": str(path),
            "traced_ms": 2.0,
            "rounds": 3,
            "replicas": [
                {
                    "worker": 0,
                    "replica": 0,
                    "tracks": ["replica 0"],
                    "compute_ms": 1.58,
                    "compute_share": 0.79,
                    "merge_wait_ms": 0.03,
                    "merge_wait_share": 0.015,
                    "merge_waits": 3,
                    "last_arrivals": 1,
                },
                {
                    "worker": 0,
                    "replica": 1,
                    "tracks": ["replica 1"],
                    "compute_ms": 1.66,
                    "compute_share": 0.83,
                    "merge_wait_ms": 0.06,
                    "merge_wait_share": 0.03,
                    "merge_waits": 3,
                    "last_arrivals": 2,
                },
                {
                    "worker": 0,
                    "replica": 2,
                    "tracks": ["replica 2"],
                    "compute_ms": 1.59,
                    "compute_share": 0.795,
                    "merge_wait_ms": 0.09,
                    "merge_wait_share": 0.045,
                    "merge_waits": 3,
                    "last_arrivals": 0,
                },
            ],
            "last_most_often": {"worker": 0, "replica": 1, "rounds": 2},
        }

    def test_text(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """The text form: a heading, an aligned row per replica, and the last arrival."""
        path = _write(tmp_path / "run.json", _three_replicas())
        assert main(["trace-summary", str(path)]) == 0
        assert capsys.readouterr().out == (
            f"{path}: 3 replicas, 2.000 ms traced, 3 merge rounds\n"
            "worker  replica  compute ms  share  merge wait ms  share  last in\n"
            "     0        0       1.580  79.0%          0.030   1.5%      1/3\n"
            "     0        1       1.660  83.0%          0.060   3.0%      2/3\n"
            "     0        2       1.590  79.5%          0.090   4.5%      0/3\n"
            "arrived last most often: replica 1 (worker 0), in 2 of 3 merge rounds\n"
        )

    def test_rounds_are_per_worker(self, tmp_path: Path) -> None:
        """Round numbers are a worker's own: two workers' round 0 are two rounds. A tie in
        how often replicas were last goes to the lowest (worker, replica)."""
        events = [_meta(0, 0, "replica 0"), _meta(0, 1, "replica 1")]
        events += [_meta(1, 2, "replica 2"), _meta(1, 3, "replica 3")]
        events += [
            _span("merge wait", 0, 0, 0, 5, round=0),
            _span("merge wait", 0, 1, 4, 1, round=0),  # last of worker 0
            _span("merge wait", 1, 2, 3, 2, round=0),  # last of worker 1, though worker 0's
            _span("merge wait", 1, 3, 0, 5, round=0),  # replica 1 came later
        ]
        summary = _summary(_write(tmp_path / "run.json", events))
        assert summary["rounds"] == 2
        assert [r["last_arrivals"] for r in summary["replicas"]] == [0, 1, 1, 0]
        assert summary["last_most_often"] == {"worker": 0, "replica": 1, "rounds": 1}

    def test_further_tracks_of_a_replica_count_for_it(self, tmp_path: Path) -> None:
        """The recorder's second track of a replica ("replica 0 (2)", e.g. for overlapping
        runs) counts for that replica: its totals, its arrivals, its list of tracks."""
        events = [
            _meta(0, 0, "replica 0"),
            _meta(0, 1, "replica 1"),
            _meta(0, 2, "main"),
            _meta(0, 3, "replica 0 (2)"),
            _span("compute", 0, 0, 0, 10),
            _span("merge wait", 0, 0, 10, 5, round=1),  # last of round 1
            _span("compute", 0, 1, 0, 5),
            _span("merge wait", 0, 1, 5, 10, round=1),
            _span("compute", 0, 3, 20, 30),
            _span("merge wait", 0, 3, 50, 10, round=2),
            _span("compute", 0, 1, 20, 40),
            _span("merge wait", 0, 1, 60, 0, round=2),  # last of round 2
        ]
        summary = _summary(_write(tmp_path / "run.json", events))
        rows = [
            (r["replica"], r["tracks"], r["compute_ms"], r["merge_wait_ms"], r["merge_waits"])
            for r in summary["replicas"]
        ]
        assert rows == [
            (0, ["replica 0", "replica 0 (2)"], 0.04, 0.015, 2),
            (1, ["replica 1"], 0.045, 0.01, 2),
        ]
        assert [r["last_arrivals"] for r in summary["replicas"]] == [1, 1]
        assert summary["rounds"] == 2

    def test_array_form(self, tmp_path: Path) -> None:
        """A file holding the bare event list (the format's array form) is read as well."""
        path = tmp_path / "run.json"
        path.write_text(json.dumps(_three_replicas()), encoding="utf-8")
        summary = _summary(path)
        assert summary["last_most_often"] == {"worker": 0, "replica": 1, "rounds": 2}

    def test_no_merge_round(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A trace whose replicas never merged: totals, and no last arrival."""
        events = [_meta(0, 0, "replica 0"), _span("compute", 0, 0, 0, 400)]
        path = _write(tmp_path / "run.json", events)
        assert _summary(path)["last_most_often"] is None
        assert main(["trace-summary", str(path)]) == 0
        assert capsys.readouterr().out.splitlines()[-1] == (
            "arrived last most often: - (no merge round in the trace)"
        )

    def test_no_spans(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """Replica tracks without a span: nothing traced, no shares."""
        path = _write(tmp_path / "run.json", [_meta(0, 0, "replica 0")])
        summary = _summary(path)
        assert summary["traced_ms"] is None
        assert summary["replicas"][0]["compute_share"] is None
        assert main(["trace-summary", str(path)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == f"{path}: 1 replica, no spans traced, 0 merge rounds"
        assert lines[2].split() == ["0", "0", "0.000", "-", "0.000", "-", "0/0"]

    @pytest.mark.parametrize(
        ("content", "problem"),
        [
            pytest.param(None, "no such file", id="missing"),
            pytest.param(b"", "is a directory", id="directory"),
            pytest.param(
                b'{"traceEvents": [',
                "not JSON (Expecting value at line 1 column 18)",
                id="truncated",
            ),
            pytest.param(b"\xff\xfe{", "not JSON (not UTF-8 text)", id="binary"),
            pytest.param(
                b'{"foo": 1}',
                "not a Chrome trace: no \"traceEvents\" list (an object with keys ['foo'])",
                id="not-a-trace",
            ),
            pytest.param(
                b"3", 'not a Chrome trace: no "traceEvents" list (a JSON number)', id="number"
            ),
            pytest.param(
                json.dumps({"traceEvents": [_meta(0, 0, "main")]}).encode(),
                'no replica tracks (no "thread_name" metadata event names a track "replica r")',
                id="no-replica-tracks",
            ),
            pytest.param(
                json.dumps({"traceEvents": [_meta(0, 0, "replica 0"), 7]}).encode(),
                "event 1 is not an object (a JSON number)",
                id="event-not-an-object",
            ),
            pytest.param(
                json.dumps(
                    {"traceEvents": [{"ph": "X", "name": "compute", "ts": "soon", "dur": 1}]}
                ).encode(),
                "event 0 ('compute') is a complete event without a number \"ts\" and a "
                'non-negative number "dur"',
                id="bad-span",
            ),
            pytest.param(
                json.dumps({"traceEvents": [_meta([0], 0, "replica 0")]}).encode(),  # type: ignore[arg-type]
                'event 0 (\'thread_name\') has a "pid" or a "tid" that is not a number or a string',
                id="pid-a-list",
            ),
            pytest.param(
                json.dumps(
                    {"traceEvents": [_meta(0, 0, "replica 0"), _span("compute", 0, {}, 0, 1)]}  # type: ignore[arg-type]
                ).encode(),
                'event 1 (\'compute\') has a "pid" or a "tid" that is not a number or a string',
                id="tid-an-object",
            ),
            pytest.param(
                b"[" * 100_000 + b"]" * 100_000,
                "not JSON (nested too deeply)",
                id="nested-too-deeply",
            ),
            pytest.param(
                json.dumps(
                    {
                        "traceEvents": [
                            _meta(0, 0, "replica 0"),
                            _span("compute", 0, 0, 1e308, 1e308),
                        ]
                    }
                ).encode(),
                "its times are too large to add up",
                id="times-too-large",
            ),
        ],
    )
    def test_unreadable_file(
        self,
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
        content: bytes | None,
        problem: str,
    ) -> None:
        """A file it cannot read: status 2 and one line naming the file, what is wrong, and
        what to pass instead; nothing on stdout."""
        path = tmp_path / "run.json"
        if content == b"":
            path.mkdir()
        elif content is not None:
            path.write_bytes(content)
        assert main(["trace-summary", str(path), "--json"]) == 2
        out = capsys.readouterr()
        assert out.out == ""
        assert out.err.startswith(f"python -m aioreplica trace-summary: error: {path}: {problem}")
        assert "pass the JSON file that strategy.trace(...) wrote" in out.err
        assert out.err.count("\n") == 1
        assert out.err.endswith("\n")

    @pytest.mark.timeout(60)
    def test_as_a_command(self, tmp_path: Path) -> None:
        """Through ``python -m aioreplica``: the summary on stdout, and status 2 with the
        message on stderr for a file that does not exist."""
        path = _write(tmp_path / "run.json", _three_replicas())
        completed = _cli("trace-summary", str(path), "--json")
        assert (completed.returncode, completed.stderr) == (0, "")
        assert json.loads(completed.stdout) == _summary(path)
        missing = _cli("trace-summary", str(tmp_path / "gone.json"))
        assert (missing.returncode, missing.stdout) == (2, "")
        assert missing.stderr == (
            f"python -m aioreplica trace-summary: error: {tmp_path / 'gone.json'}: no such "
            "file: pass the JSON file that strategy.trace(...) wrote\n"
        )


@pytest.mark.anyio
async def test_summarizes_a_trace_the_strategy_wrote(tmp_path: Path) -> None:
    """End to end: a trace from ``strategy.trace`` is read, and the replica that is made to
    arrive late at every merge point (the others go straight there) is found last in every
    round, its wait the shortest."""
    strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])

    async def step() -> Any:
        context = aioreplica.get_replica_context()
        assert context is not None
        if context.replica_id_in_sync_group == 2:
            await anyio.sleep(0.005)
        return await context.all_reduce(aioreplica.ReduceOp.SUM, np.ones(2))

    async with strategy.trace(tmp_path / "run.json") as path:
        for _ in range(3):
            await strategy.run(step)
    summary = _summary(Path(path))
    assert summary["rounds"] == 3
    assert [(r["replica"], r["tracks"], r["merge_waits"]) for r in summary["replicas"]] == [
        (0, ["replica 0"], 3),
        (1, ["replica 1"], 3),
        (2, ["replica 2"], 3),
    ]
    assert [r["last_arrivals"] for r in summary["replicas"]] == [0, 0, 3]
    assert summary["last_most_often"] == {"worker": 0, "replica": 2, "rounds": 3}
    waits = [r["merge_wait_ms"] for r in summary["replicas"]]
    assert min(waits[0], waits[1]) > waits[2]
    assert summary["replicas"][2]["compute_ms"] >= 3 * 4.0  # three sleeps of 5 ms


def _summary(path: Path) -> dict[str, Any]:
    from aioreplica._cli import summarize_trace

    return summarize_trace(path)
