"""The command line: ``python -m aioreplica``.

Usage::

    python -m aioreplica info [--json]
    python -m aioreplica trace-summary RUN.json [--json]
    python -m aioreplica --version
    python -m aioreplica --help

``info``
    What this installation can run on: the versions of Python, NumPy, anyio, trio, uvloop,
    CuPy, the CUDA runtime and driver, NCCL, mpi4py and the MPI library; the devices
    (``aioreplica.list_devices()``); and, for each backend, what is missing and how to get it.
    A module that is installed but fails to import (any exception, ``SystemExit`` included)
    is reported with its error; the command itself does not fail. What a module prints as it
    imports goes to stderr, so that stdout holds only the report. Optional modules are
    imported only here, never by ``import aioreplica``; MPI is not initialised (mpi4py's
    ``rc.initialize`` is turned off before ``mpi4py.MPI`` is first imported), so ``info`` is
    safe on a login node.

    ``--json`` prints one object with these keys:

    - ``aioreplica``: this package's version.
    - ``python``: ``{"version": platform.python_version(), "full": sys.version,
      "implementation": ..., "executable": sys.executable}``.
    - ``platform``: ``platform.platform()``.
    - ``packages``: for each of ``numpy``, ``anyio``, ``trio``, ``uvloop``, ``cupy``,
      ``mpi4py``: ``{"installed": bool, "version": str | None, "error": str | None,
      "warnings": [str, ...]}``; ``error`` is the import error of an installed module,
      ``warnings`` what importing it warned.
    - ``cuda``: ``{"runtime": "12.4" | None, "driver": "12.8" | None, "error": str | None}``.
    - ``nccl``: ``{"available": bool, "version": "2.20.5" | None, "error": str | None}``.
    - ``mpi``: ``{"library": str | None, "standard": "4.1" | None, "error": str | None}``;
      ``library`` is ``MPI.Get_library_version()`` as the library words it.
    - ``devices``: the device names, as ``aioreplica.list_devices()`` gives them.
    - ``gpus``: one ``{"device": "gpu:0", "name": str | None, "memory_bytes": int | None,
      "compute_capability": "9.0" | None, "error": str | None}`` per GPU.
    - ``backends``: ``{"host": ..., "gpu": ..., "nccl": ..., "multi_worker": ...}``, each
      ``{"ready": bool, "missing": [str, ...]}``: why it cannot run here, with what to do.
    - ``missing``: the same reasons as one list of lines, ``"GPU: CuPy is not installed: ..."``.

``trace-summary RUN.json``
    Reads a Chrome Trace Event file written by ``strategy.trace(...)`` and prints, for each
    replica (a ``thread_name`` metadata event names its track ``"replica r"``, pid = worker,
    tid = replica id; the recorder's further tracks of a replica, ``"replica r (2)"``, ...,
    count for replica ``r``), the total time in ``"compute"`` and in ``"merge wait"`` spans,
    in milliseconds and as a share of the traced time (first span start to last span end,
    over every track of the file), and which replica arrived last most often: in each merge
    round (a worker's ``"merge wait"`` spans with one ``args.round``) the replica whose wait
    began latest arrived last (on a tie, the lowest replica id). Other tracks ("main",
    "prefetch", ...) count towards the traced time only.

    ``--json`` prints one object: ``file``; ``traced_ms`` (``None`` for a trace without
    spans); ``rounds`` (merge rounds seen); ``replicas``, a list sorted by (worker, replica)
    of ``{"worker", "replica", "tracks", "compute_ms", "compute_share", "merge_wait_ms",
    "merge_wait_share", "merge_waits", "last_arrivals"}`` (``tracks``: the names of the
    replica's tracks; shares are fractions of the traced time, ``None`` when nothing was
    traced); and ``last_most_often``, ``{"worker", "replica", "rounds"}`` or ``None`` when the
    trace has no merge round.

Exit status: 0 on success; 2 on a usage error or a trace file that cannot be read (missing,
not JSON, not a trace, a malformed event, no replica tracks), with a one-line message on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import platform
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from types import ModuleType

__all__ = [
    "TraceFileError",
    "collect_info",
    "format_info",
    "format_trace_summary",
    "main",
    "summarize_trace",
]

PROG: Final = "python -m aioreplica"

#: The modules ``info`` reports, in order, with the name it shows for each.
_PACKAGES: Final = {
    "numpy": "NumPy",
    "anyio": "anyio",
    "trio": "trio",
    "uvloop": "uvloop",
    "cupy": "CuPy",
    "mpi4py": "mpi4py",
}

_INSTALL_CUPY: Final = "pip install 'aioreplica[cuda]'"
_INSTALL_MPI: Final = "pip install 'aioreplica[mpi]'"

#: The backends ``info`` reports on, with the label its text output gives each.
_BACKEND_LABELS: Final = {
    "host": "host",
    "gpu": "GPU",
    "nccl": "NCCL",
    "multi_worker": "multi-worker",
}


# -- info ----------------------------------------------------------------------------------


def _error_text(exc: BaseException) -> str:
    """``"ImportError: message"``, the way a traceback's last line shows an exception."""
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


@contextlib.contextmanager
def _recording_warnings(into: list[str]) -> Iterator[None]:
    """Catch the warnings raised inside the block (each once) and append their text to ``into``.

    Importing CuPy or its NCCL module warns about a missing library; under ``-W error`` that
    would be an exception, so ``info`` records the warning instead of letting it escape.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for warning in caught:
        text = f"{warning.category.__name__}: {warning.message}"
        if text not in into:
            into.append(text)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send what the block prints to stderr: a module that prints as it imports must not
    break the JSON that ``info --json`` prints on stdout."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _version_of(module: ModuleType, name: str) -> str | None:
    """The module's ``__version__``, else its distribution's version, else ``None``."""
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version(name)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def _probe(name: str) -> tuple[ModuleType | None, dict[str, Any]]:
    """Import ``name`` if it is installed: the module (or ``None``) and its ``packages`` entry."""
    entry: dict[str, Any] = {"installed": False, "version": None, "error": None, "warnings": []}
    try:
        installed = name in sys.modules or importlib.util.find_spec(name) is not None
    except (ImportError, ValueError) as exc:  # a broken finder, or a module without a spec
        entry.update(installed=True, error=_error_text(exc))
        return None, entry
    if not installed:
        return None, entry
    entry["installed"] = True
    try:
        with _recording_warnings(entry["warnings"]), _stdout_to_stderr():
            module = importlib.import_module(name)
    except (Exception, SystemExit) as exc:  # a broken install raises anything: ImportError, ...
        entry["error"] = _error_text(exc)
        return None, entry
    entry["version"] = _version_of(module, name)
    return module, entry


def _cuda_version(code: int) -> str:
    """CUDA's version code as text: ``12040`` is ``"12.4"`` (1000 * major + 10 * minor)."""
    return f"{code // 1000}.{code % 1000 // 10}"


def _nccl_version(code: int) -> str:
    """NCCL's version code as text: ``22005`` is ``"2.20.5"``, ``2708`` (before 2.9) ``"2.7.8"``."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def _cuda_info(cupy: Any) -> dict[str, Any]:
    """The ``cuda`` entry: runtime and driver versions as CuPy reports them."""
    entry: dict[str, Any] = {"runtime": None, "driver": None, "error": None}
    errors = []
    try:
        entry["runtime"] = _cuda_version(int(cupy.cuda.runtime.runtimeGetVersion()))
    except Exception as exc:  # CuPy cannot load the CUDA runtime library
        errors.append(f"runtime: {_error_text(exc)}")
    try:
        driver = int(cupy.cuda.runtime.driverGetVersion())
    except Exception as exc:  # no driver library
        errors.append(f"driver: {_error_text(exc)}")
    else:
        if driver == 0:
            errors.append("driver: no CUDA driver is installed")
        else:
            entry["driver"] = _cuda_version(driver)
    entry["error"] = "; ".join(errors) or None
    return entry


def _gpu_count(cupy: Any) -> tuple[int, str | None]:
    """How many GPUs CuPy sees, and the error that stopped it from seeing any."""
    try:
        return int(cupy.cuda.runtime.getDeviceCount()), None
    except Exception as exc:  # cudaErrorNoDevice, cudaErrorInsufficientDriver, ...
        return 0, _error_text(exc)


def _gpu_info(cupy: Any, index: int) -> dict[str, Any]:
    """One ``gpus`` entry: the GPU's model, memory and compute capability."""
    entry: dict[str, Any] = {
        "device": f"gpu:{index}",
        "name": None,
        "memory_bytes": None,
        "compute_capability": None,
        "error": None,
    }
    try:
        properties = cupy.cuda.runtime.getDeviceProperties(index)
    except Exception as exc:
        entry["error"] = _error_text(exc)
        return entry
    name = properties.get("name")
    entry["name"] = name.decode(errors="replace") if isinstance(name, bytes) else name
    memory = properties.get("totalGlobalMem")
    entry["memory_bytes"] = int(memory) if memory is not None else None
    if "major" in properties and "minor" in properties:
        entry["compute_capability"] = f"{properties['major']}.{properties['minor']}"
    return entry


def _nccl_info() -> dict[str, Any]:
    """The ``nccl`` entry: whether CuPy can load NCCL (``cupy.cuda.nccl.available``).

    CuPy's wheels do not bundle NCCL; importing ``cupy.cuda.nccl`` then warns and gives a
    stub with ``available`` false. The warning, recorded, is the error reported.
    """
    entry: dict[str, Any] = {"available": False, "version": None, "error": None}
    caught: list[str] = []
    try:
        with _recording_warnings(caught), _stdout_to_stderr():
            nccl = importlib.import_module("cupy.cuda.nccl")
    except (Exception, SystemExit) as exc:
        entry["error"] = _error_text(exc)
        return entry
    if not getattr(nccl, "available", False):
        entry["error"] = "; ".join(caught) or "cupy.cuda.nccl.available is false"
        return entry
    entry["available"] = True
    with contextlib.suppress(Exception):
        entry["version"] = _nccl_version(int(nccl.get_version()))
    return entry


#: Run in a child process: it loads the MPI library without initialising MPI, and a library
#: that crashes on load takes only the child down.
_MPI_PROBE: Final = """\
import json
try:
    import mpi4py
    mpi4py.rc.initialize = False
    from mpi4py import MPI
    found = {"library": str(MPI.Get_library_version()), "standard": list(MPI.Get_version())}
except Exception as exc:
    found = {"error": f"{type(exc).__name__}: {str(exc).strip()}"}
print(json.dumps(found))
"""


_MPI_PROBE_TIMEOUT: Final = 60


def _ended(status: int, stderr: str) -> str:
    """Why the MPI probe's process ended: its exit status or signal, and its last words."""
    if status < 0:
        try:
            how = f"killed by {signal.Signals(-status).name}"
        except ValueError:
            how = f"killed by signal {-status}"
    else:
        how = f"exit status {status}"
    last = (stderr.strip().splitlines() or [""])[-1]
    return f"loading it ended the process ({how})" + (f": {last}" if last else "")


def _mpi_info() -> dict[str, Any]:
    """The ``mpi`` entry: the MPI library mpi4py loads, without initialising MPI here.

    ``MPI_Get_library_version`` and ``MPI_Get_version`` may be called before ``MPI_Init``;
    ``MPI_Init`` itself can fail, or wait for a process manager, on a login node. Where this
    process has not imported ``mpi4py.MPI`` yet, a child process asks, so this one is left as
    it was (importing ``mpi4py.MPI`` with ``rc.initialize`` off here would leave an MPI module
    that never initialises).
    """
    entry: dict[str, Any] = {"library": None, "standard": None, "error": None}
    try:
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None:
            found = {
                "library": str(mpi.Get_library_version()),
                "standard": list(mpi.Get_version()),
            }
        else:
            try:
                child = subprocess.run(
                    [sys.executable, "-c", _MPI_PROBE],
                    capture_output=True,
                    text=True,
                    check=False,
                    timeout=_MPI_PROBE_TIMEOUT,
                )
            except subprocess.TimeoutExpired:
                entry["error"] = f"loading it did not finish within {_MPI_PROBE_TIMEOUT} s"
                return entry
            if child.returncode != 0:  # the library crashed the interpreter as it loaded
                entry["error"] = _ended(child.returncode, child.stderr)
                return entry
            found = json.loads(child.stdout)
        if "error" in found:
            entry["error"] = str(found["error"])
            return entry
        entry["library"] = str(found["library"]).strip()
        major, minor = found["standard"]
        entry["standard"] = f"{major}.{minor}"
    except Exception as exc:  # an mpi4py that answers something unexpected
        entry["error"] = _error_text(exc)
    return entry


def _list_devices() -> tuple[list[str], str | None]:
    """``aioreplica.list_devices()``, or the host device and the error where that failed."""
    from ._backends import list_devices

    try:
        with _stdout_to_stderr():
            return list_devices(), None
    except (Exception, SystemExit) as exc:  # a CuPy that finds its libraries missing on first use
        return ["cpu:0"], _error_text(exc)


def _reason(what: str, error: str | None, fix: str) -> str:
    """One ``missing`` line: what is wrong, the error behind it, and what to do.

    An error of several lines (mpi4py lists every path it tried) follows the fix on lines of
    its own.
    """
    if not error:
        return f"{what}: {fix}"
    if "\n" in error:
        return f"{what}: {fix}\n{error}"
    return f"{what} ({error}): {fix}"


def _gpu_backend(
    cupy: Any, package: dict[str, Any], missing: dict[str, list[str]]
) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """The ``cuda``, ``nccl`` and ``gpus`` entries; what the GPU and NCCL backends miss."""
    cuda: dict[str, Any] = {"runtime": None, "driver": None, "error": None}
    nccl: dict[str, Any] = {"available": False, "version": None, "error": None}
    gpus: list[dict[str, Any]] = []
    if not package["installed"]:
        missing["gpu"].append(f"CuPy is not installed: {_INSTALL_CUPY}")
        cuda["error"] = nccl["error"] = "CuPy is not installed"
    elif cupy is None:
        missing["gpu"].append(
            _reason(
                "CuPy is installed but does not import",
                package["error"],
                f"reinstall the CuPy wheel that matches your CUDA ({_INSTALL_CUPY} installs "
                "the one for CUDA 12)",
            )
        )
        cuda["error"] = nccl["error"] = "CuPy does not import"
    else:
        cuda = _cuda_info(cupy)
        count, count_error = _gpu_count(cupy)
        if count == 0:
            missing["gpu"].append(
                _reason(
                    "CuPy found no CUDA device",
                    count_error,
                    "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES",
                )
            )
        gpus = [_gpu_info(cupy, index) for index in range(count)]
        nccl = _nccl_info()
    if missing["gpu"]:
        missing["nccl"].append("needs the GPU backend (see GPU)")
    elif not nccl["available"]:
        major = cuda["runtime"].split(".")[0] if cuda["runtime"] else "12"
        missing["nccl"].append(
            _reason(
                "CuPy cannot load NCCL, which several GPUs in one process need",
                nccl["error"],
                f"pip install nvidia-nccl-cu{major}, or python -m cupyx.tools.install_library "
                f"--library nccl --cuda {major}.x",
            )
        )
    return cuda, nccl, gpus


def _mpi_backend(
    mpi4py: Any, package: dict[str, Any], missing: dict[str, list[str]]
) -> dict[str, Any]:
    """The ``mpi`` entry; what the multi-worker backend misses."""
    if not package["installed"]:
        missing["multi_worker"].append(f"mpi4py is not installed: {_INSTALL_MPI}")
        return {"library": None, "standard": None, "error": "mpi4py is not installed"}
    if mpi4py is None:
        missing["multi_worker"].append(
            _reason(
                "mpi4py is installed but does not import",
                package["error"],
                f"reinstall it: {_INSTALL_MPI}",
            )
        )
        return {"library": None, "standard": None, "error": "mpi4py does not import"}
    mpi = _mpi_info()
    if mpi["error"] is not None:
        missing["multi_worker"].append(
            _reason(
                "mpi4py cannot load an MPI library",
                mpi["error"],
                "install one (pip install mpich), or load your cluster's MPI so that mpi4py "
                "finds its libmpi",
            )
        )
    return mpi


def collect_info() -> dict[str, Any]:
    """What this installation can run on, as the JSON object ``info --json`` prints.

    Imports the optional modules (CuPy, trio, mpi4py, ...) that are installed. It does not
    raise on a broken installation: a module that fails to import is reported with its error.
    MPI is not initialised (the MPI library is asked in a child process, unless this one has
    imported ``mpi4py.MPI`` already).

    Returns:
        The report; its keys are listed in this module's docstring.

    Example:
        >>> info = collect_info()
        >>> info["devices"][-1], info["backends"]["host"]
        ('cpu:0', {'ready': True, 'missing': []})
    """
    from . import __version__

    packages: dict[str, dict[str, Any]] = {}
    modules: dict[str, Any] = {}
    for name in _PACKAGES:
        modules[name], packages[name] = _probe(name)

    missing: dict[str, list[str]] = {key: [] for key in _BACKEND_LABELS}
    cuda, nccl, gpus = _gpu_backend(modules["cupy"], packages["cupy"], missing)
    mpi = _mpi_backend(modules["mpi4py"], packages["mpi4py"], missing)
    devices, devices_error = _list_devices()
    if devices_error is not None and not missing["gpu"]:
        missing["gpu"].append(
            _reason("aioreplica.list_devices() failed", devices_error, "see the CuPy lines above")
        )

    return {
        "aioreplica": __version__,
        "python": {
            "version": platform.python_version(),
            "full": sys.version,
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": platform.platform(),
        "packages": packages,
        "cuda": cuda,
        "nccl": nccl,
        "mpi": mpi,
        "devices": devices,
        "gpus": gpus,
        "backends": {
            key: {"ready": not reasons, "missing": reasons} for key, reasons in missing.items()
        },
        "missing": [
            f"{_BACKEND_LABELS[key]}: {reason}"
            for key, reasons in missing.items()
            for reason in reasons
        ],
    }


def _table(rows: Sequence[tuple[str, str]], indent: str = "") -> list[str]:
    """Two aligned columns; a value of several lines continues under its first line."""
    width = max((len(label) for label, _ in rows), default=0) + 2
    lines = []
    for label, value in rows:
        first, *rest = value.splitlines() or [""]
        lines.append(f"{indent}{label:<{width}}{first}".rstrip())
        lines += [f"{indent}{'':<{width}}{line}".rstrip() for line in rest]
    return lines


def _package_text(entry: dict[str, Any]) -> str:
    if not entry["installed"]:
        return "not installed"
    if entry["error"] is not None:
        return f"does not import: {entry['error']}"
    return str(entry["version"] or "installed (version unknown)")


def _first_line(text: str) -> str:
    """The first line of an MPI library's self-description, its runs of blanks made one.

    MPICH's first line is ``MPICH Version: 5.0.2``; Open MPI's is a long comma-separated
    line that starts with ``Open MPI v5.0.5``: it is cut at the first comma.
    """
    first = " ".join(text.strip().splitlines()[0].split()) if text.strip() else ""
    return first.split(", ")[0] if len(first) > 60 else first


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def format_info(info: dict[str, Any]) -> str:
    """The text ``info`` prints for a report from :func:`collect_info`: aligned, one fact a line.

    Args:
        info: the report.

    Returns:
        The text, ending with a newline.

    Raises:
        KeyError: ``info`` lacks a key :func:`collect_info` writes.

    Example:
        >>> text = format_info(collect_info())
        >>> text.splitlines()[0].split()[0], "devices" in text
        ('aioreplica', True)
    """
    python = info["python"]
    rows: list[tuple[str, str]] = [
        ("aioreplica", info["aioreplica"]),
        ("Python", f"{python['version']} ({python['implementation']}, {python['executable']})"),
        ("platform", info["platform"]),
    ]
    rows += [(label, _package_text(info["packages"][name])) for name, label in _PACKAGES.items()]
    cuda, nccl, mpi = info["cuda"], info["nccl"], info["mpi"]
    rows += [
        ("CUDA runtime", cuda["runtime"] or "-"),
        ("CUDA driver", cuda["driver"] or "-"),
        ("NCCL", (nccl["version"] or "available") if nccl["available"] else "-"),
        ("MPI library", _first_line(mpi["library"]) if mpi["library"] else "-"),
        ("MPI standard", mpi["standard"] or "-"),
        ("devices", ", ".join(info["devices"])),
    ]
    for gpu in info["gpus"]:
        if gpu["error"] is not None:
            rows.append((gpu["device"], f"properties unavailable: {gpu['error']}"))
            continue
        facts = [str(gpu["name"])]
        if gpu["memory_bytes"] is not None:
            facts.append(_gib(gpu["memory_bytes"]))
        if gpu["compute_capability"] is not None:
            facts.append(f"compute capability {gpu['compute_capability']}")
        rows.append((gpu["device"], ", ".join(facts)))
    lines = _table(rows)
    ready = [label for key, label in _BACKEND_LABELS.items() if info["backends"][key]["ready"]]
    lines += ["", *_table([("ready", ", ".join(ready) or "-")])]
    if info["missing"]:
        lines += ["missing"]
        for reason in info["missing"]:
            first, *rest = reason.splitlines()
            lines += [f"  {first}", *(f"    {line}" for line in rest)]
    return "\n".join(lines) + "\n"


# -- trace-summary -------------------------------------------------------------------------


class TraceFileError(ValueError):
    """A trace file ``trace-summary`` cannot read; the message is one line: file, problem, fix."""


_WHAT_TO_PASS: Final = "pass the JSON file that strategy.trace(...) wrote"


def _json_type(value: object) -> str:
    """The JSON name of a decoded value's type: ``"array"``, ``"number"``, ``"null"``..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list):
        return "array"
    return "string" if isinstance(value, str) else "object"


def _load_events(path: Path) -> list[Any]:
    """The trace's event list, or a :class:`TraceFileError` saying why there is none."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceFileError(f"{path}: no such file: {_WHAT_TO_PASS}") from None
    except IsADirectoryError:
        raise TraceFileError(f"{path}: is a directory: {_WHAT_TO_PASS}") from None
    except UnicodeDecodeError:
        raise TraceFileError(f"{path}: not JSON (not UTF-8 text): {_WHAT_TO_PASS}") from None
    except OSError as exc:
        raise TraceFileError(f"{path}: cannot read it ({exc.strerror}): {_WHAT_TO_PASS}") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise TraceFileError(f"{path}: not JSON (nested too deeply): {_WHAT_TO_PASS}") from None
    except json.JSONDecodeError as exc:
        raise TraceFileError(
            f"{path}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): "
            f"{_WHAT_TO_PASS}, after the trace block has exited"
        ) from None
    events: list[Any] | None = None
    if isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
        events = data["traceEvents"]
    elif isinstance(data, list):  # the Trace Event format's array form: the events alone
        events = data
    if events is not None:
        return events
    found = (
        f"an object with keys {sorted(data)[:5]}"
        if isinstance(data, dict)
        else f"a JSON {_json_type(data)}"
    )
    raise TraceFileError(
        f'{path}: not a Chrome trace: no "traceEvents" list ({found}): {_WHAT_TO_PASS}'
    )


def _number(event: dict[str, Any], key: str) -> float | None:
    value = event.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _track_of(path: Path, index: int, event: dict[str, Any]) -> tuple[Any, Any]:
    """The event's ``(pid, tid)``, or a :class:`TraceFileError` if either is an array or an
    object (a track id is a number or a string)."""
    pid, tid = event.get("pid"), event.get("tid")
    if isinstance(pid, list | dict) or isinstance(tid, list | dict):
        raise TraceFileError(
            f'{path}: event {index} ({event.get("name")!r}) has a "pid" or a "tid" that is not '
            f"a number or a string: {_WHAT_TO_PASS}"
        )
    return pid, tid


def _id_order(value: object) -> tuple[int, float, str]:
    """Sort numbers by value, before anything else (ids are ints in our traces)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value))


def _track_order(track: tuple[object, object]) -> tuple[tuple[int, float, str], ...]:
    return (_id_order(track[0]), _id_order(track[1]))


#: A replica's track: ``replica 3``, or ``replica 3 (2)`` for a second track of replica 3
#: (the recorder opens one where a span could not nest on the first, e.g. overlapping runs).
_REPLICA_TRACK: Final = re.compile(r"replica (\d+)(?: \(\d+\))?")

#: The replica tracks: (pid, tid) -> ((worker, replica id), track name).
_Lanes = dict[tuple[Any, Any], tuple[tuple[Any, Any], str]]


def _read_trace(path: Path) -> tuple[_Lanes, list[tuple[dict[str, Any], float, float]]]:
    """The replica tracks of a trace, and its complete events with their start and duration.

    Each replica track is mapped to its worker and replica id, the number in its name (the
    tid, for a name that starts with "replica" but carries no number), and to its name.
    """
    events = _load_events(path)
    lanes: _Lanes = {}
    spans: list[tuple[dict[str, Any], float, float]] = []
    for index, event in enumerate(events):
        if not isinstance(event, dict):
            raise TraceFileError(
                f"{path}: event {index} is not an object (a JSON {_json_type(event)}): "
                f"{_WHAT_TO_PASS}"
            )
        phase = event.get("ph")
        if phase == "M" and event.get("name") == "thread_name":
            args = event.get("args")
            name = args.get("name") if isinstance(args, dict) else None
            if isinstance(name, str) and name.startswith("replica"):
                pid, tid = _track_of(path, index, event)
                match = _REPLICA_TRACK.fullmatch(name)
                lanes[pid, tid] = ((pid, int(match.group(1)) if match else tid), name)
        elif phase == "X":
            start, duration = _number(event, "ts"), _number(event, "dur")
            if start is None or duration is None or duration < 0:
                raise TraceFileError(
                    f"{path}: event {index} ({event.get('name')!r}) is a complete event "
                    f'without a number "ts" and a non-negative number "dur": {_WHAT_TO_PASS}'
                )
            _track_of(path, index, event)
            spans.append((event, start, duration))
    if not lanes:
        raise TraceFileError(
            f'{path}: no replica tracks (no "thread_name" metadata event names a track '
            f'"replica r"): {_WHAT_TO_PASS}, with at least one run() inside the block'
        )
    return lanes, spans


def summarize_trace(path: str | Path) -> dict[str, Any]:
    """Per-replica compute and merge-wait totals of a trace that ``strategy.trace`` wrote.

    Args:
        path: the Chrome Trace Event JSON file.

    Returns:
        The summary ``trace-summary --json`` prints (keys in this module's docstring).

    Raises:
        TraceFileError: the file is missing or unreadable, is not JSON (or nested too deeply
            to read), is not a trace (no ``traceEvents``), has a malformed complete event or
            an event whose ``pid`` or ``tid`` is an array or an object, has no replica track,
            or has times too large to add up.

    Example:
        >>> events = [
        ...     {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0,
        ...      "args": {"name": "replica 0"}},
        ...     {"ph": "X", "name": "compute", "pid": 0, "tid": 0, "ts": 0, "dur": 750},
        ...     {"ph": "X", "name": "merge wait", "pid": 0, "tid": 0, "ts": 750, "dur": 250,
        ...      "args": {"round": 0}},
        ... ]
        >>> _ = (tmp / "run.json").write_text(json.dumps({"traceEvents": events}))
        >>> summary = summarize_trace(tmp / "run.json")
        >>> summary["traced_ms"], summary["replicas"][0]["compute_share"]
        (1.0, 0.75)
        >>> try:
        ...     summarize_trace(tmp / "missing.json")
        ... except TraceFileError as exc:
        ...     print(str(exc).replace(str(tmp), "tmp"))
        tmp/missing.json: no such file: pass the JSON file that strategy.trace(...) wrote
    """
    path = Path(path)
    lanes, spans = _read_trace(path)
    traced = None
    if spans:
        traced = max(start + duration for _, start, duration in spans) - min(
            start for _, start, _ in spans
        )
    replicas = sorted({replica for replica, _ in lanes.values()}, key=_track_order)
    totals = {replica: {"compute": 0.0, "merge wait": 0.0, "waits": 0} for replica in replicas}
    arrivals: dict[tuple[Any, Any], list[tuple[float, Any]]] = {}
    for event, start, duration in spans:
        lane = lanes.get((event.get("pid"), event.get("tid")))
        name = event.get("name")
        if lane is None or name not in ("compute", "merge wait"):
            continue
        replica = lane[0]
        totals[replica][name] += duration
        if name == "merge wait":
            totals[replica]["waits"] += 1
            args = event.get("args")
            merge_round = args.get("round") if isinstance(args, dict) else None
            if isinstance(merge_round, int | str) and not isinstance(merge_round, bool):
                arrivals.setdefault((replica[0], merge_round), []).append((start, replica[1]))

    last: dict[tuple[Any, Any], int] = dict.fromkeys(replicas, 0)
    for (pid, _), waits in arrivals.items():
        latest = max(start for start, _ in waits)
        last[pid, min((r for start, r in waits if start == latest), key=_id_order)] += 1

    sums = [traced or 0.0, *(t[k] for t in totals.values() for k in ("compute", "merge wait"))]
    if not all(math.isfinite(value) for value in sums):
        raise TraceFileError(f"{path}: its times are too large to add up: {_WHAT_TO_PASS}")

    def share(value: float) -> float | None:
        return round(value / traced, 4) if traced else None

    names: dict[tuple[Any, Any], list[str]] = {replica: [] for replica in replicas}
    for lane in sorted(lanes, key=_track_order):
        names[lanes[lane][0]].append(lanes[lane][1])
    most_often = None
    if arrivals:
        top = min(last, key=lambda replica: (-last[replica], _track_order(replica)))
        most_often = {"worker": top[0], "replica": top[1], "rounds": last[top]}
    return {
        "file": str(path),
        "traced_ms": None if traced is None else round(traced / 1000, 3),
        "rounds": len(arrivals),
        "replicas": [
            {
                "worker": replica[0],
                "replica": replica[1],
                "tracks": names[replica],
                "compute_ms": round(totals[replica]["compute"] / 1000, 3),
                "compute_share": share(totals[replica]["compute"]),
                "merge_wait_ms": round(totals[replica]["merge wait"] / 1000, 3),
                "merge_wait_share": share(totals[replica]["merge wait"]),
                "merge_waits": totals[replica]["waits"],
                "last_arrivals": last[replica],
            }
            for replica in replicas
        ],
        "last_most_often": most_often,
    }


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


def format_trace_summary(summary: dict[str, Any]) -> str:
    """The text ``trace-summary`` prints for a summary from :func:`summarize_trace`.

    Args:
        summary: the summary.

    Returns:
        An aligned table, one row per replica, and the replica that arrived last most often.

    Raises:
        KeyError: ``summary`` lacks a key :func:`summarize_trace` writes.

    Example:
        >>> summary = {"file": "run.json", "traced_ms": 2.0, "rounds": 1, "replicas": [
        ...     {"worker": 0, "replica": 0, "tracks": ["replica 0"], "compute_ms": 1.5,
        ...      "compute_share": 0.75, "merge_wait_ms": 0.5, "merge_wait_share": 0.25,
        ...      "merge_waits": 1, "last_arrivals": 1}],
        ...     "last_most_often": {"worker": 0, "replica": 0, "rounds": 1}}
        >>> print(format_trace_summary(summary), end="")
        run.json: 1 replica, 2.000 ms traced, 1 merge round
        worker  replica  compute ms  share  merge wait ms  share  last in
             0        0       1.500  75.0%          0.500  25.0%      1/1
        arrived last most often: replica 0 (worker 0), in 1 of 1 merge round
    """
    replicas, rounds = summary["replicas"], summary["rounds"]
    traced = summary["traced_ms"]
    head = (
        f"{summary['file']}: {len(replicas)} replica{'' if len(replicas) == 1 else 's'}, "
        f"{'no spans' if traced is None else f'{traced:.3f} ms'} traced, "
        f"{rounds} merge round{'' if rounds == 1 else 's'}"
    )
    header = ("worker", "replica", "compute ms", "share", "merge wait ms", "share", "last in")
    rows = [
        (
            str(r["worker"]),
            str(r["replica"]),
            f"{r['compute_ms']:.3f}",
            _percent(r["compute_share"]),
            f"{r['merge_wait_ms']:.3f}",
            _percent(r["merge_wait_share"]),
            f"{r['last_arrivals']}/{rounds}",
        )
        for r in replicas
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [head, "  ".join(f"{h:<{w}}" for h, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(f"{c:>{w}}" for c, w in zip(row, widths, strict=True)) for row in rows]
    most = summary["last_most_often"]
    if most is None:
        lines.append("arrived last most often: - (no merge round in the trace)")
    else:
        lines.append(
            f"arrived last most often: replica {most['replica']} (worker {most['worker']}), "
            f"in {most['rounds']} of {rounds} merge round{'' if rounds == 1 else 's'}"
        )
    return "\n".join(lines) + "\n"


# -- the command line ----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="aioreplica's command line: what this installation can run on, and "
        "summaries of traces written by strategy.trace(...).",
    )
    parser.add_argument("--version", action="version", version=f"aioreplica {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = commands.add_parser(
        "info",
        help="versions, devices, and what each backend is missing",
        description="Print the versions of Python, NumPy, anyio, trio, CuPy, CUDA, NCCL, "
        "mpi4py and MPI, the devices, and what each backend is missing here.",
    )
    info.add_argument("--json", action="store_true", help="print one JSON object")
    summary = commands.add_parser(
        "trace-summary",
        help="per-replica compute and merge-wait totals of a trace file",
        description="Summarise a Chrome Trace Event file written by strategy.trace(...): "
        "per replica, the time in compute and in merge waits, and the replica that arrived "
        "last most often.",
    )
    summary.add_argument("path", metavar="RUN.json", help="the trace file")
    summary.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m aioreplica`` with ``argv`` (default ``sys.argv[1:]``).

    Args:
        argv: the command-line arguments, without the program name.

    Returns:
        The exit status: 0, or 2 for a trace file that cannot be read.

    Raises:
        SystemExit: for ``--help``, ``--version`` and usage errors (status 2), as argparse does.

    Example:
        >>> main(["trace-summary", str(tmp / "none.json")])
        2
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "info":
        info = collect_info()
        sys.stdout.write(json.dumps(info, indent=2) + "\n" if args.json else format_info(info))
        return 0
    try:
        summary = summarize_trace(args.path)
    except TraceFileError as exc:
        sys.stderr.write(f"{PROG} trace-summary: error: {exc}\n")
        return 2
    text = json.dumps(summary, indent=2) + "\n" if args.json else format_trace_summary(summary)
    sys.stdout.write(text)
    return 0
