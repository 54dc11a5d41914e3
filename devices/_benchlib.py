"""The harness shared by the device benchmarks (``bench_scheduler.py``, ``bench_collectives.py``).

It holds what both benchmarks do the same way:

- loading aioreplica from this checkout (``load_aioreplica``, the ``Api`` it returns, and the
  ``ReplicaContext`` / ``Strategy`` protocols the benchmarks call through) and building a host
  strategy on ``cpu:0``, ``cpu:1``, ... (``host_strategy``);
- running coroutine functions on one kind of event loop (``Driver``), with a time limit on
  verification steps (``within``);
- timing (``timed_async``, ``timed_sync``) and sampling: a ``Case`` pairs a result row with its
  sample and verification functions; ``run_interleaved`` verifies and calibrates every case,
  then takes the samples interleaved (A B C A B C ...), recording the failures a row tolerates
  (``guard``);
- the command line (``bench_parser``, ``pick``), number formatting (``fmt``), the check lines
  (``print_checks``), and the JSON metadata and file (``run_meta``, ``dist_versions``,
  ``aioreplica_meta``, ``write_json``).

The benchmarks run as scripts (``python devices/bench_x.py``), so ``devices/`` is first on
``sys.path`` and they import this module as ``_benchlib``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import importlib
import importlib.metadata
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import anyio

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
VERSIONED = ("numpy", "anyio", "trio", "uvloop")
T = TypeVar("T")


# --- aioreplica, imported from this checkout ------------------------------------------------


class ReplicaContext(Protocol):
    @property
    def device(self) -> Any: ...

    @property
    def replica_id_in_sync_group(self) -> int: ...

    def merge_call(
        self,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...] = ...,
        kwargs: Mapping[str, Any] | None = ...,
    ) -> Awaitable[Any]: ...

    def all_reduce(self, op: Any, value: Any) -> Awaitable[Any]: ...


class Strategy(Protocol):
    def run(
        self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...] = ...
    ) -> Awaitable[Any]: ...

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]: ...


@dataclass
class Api:
    strategy_cls: Callable[[list[Any]], Strategy]  # device names or Device objects
    get_replica_context: Callable[[], ReplicaContext]
    per_replica: Callable[[Sequence[Any]], Any]
    distributed_values: type
    sum_op: Any
    version: str
    list_devices: Callable[[], list[str]] | None


def load_aioreplica() -> Api | str:
    """The aioreplica API, or why it cannot be imported."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        mod = importlib.import_module("aioreplica")
        reduce_op = getattr(mod, "ReduceOp", None)
        return Api(
            mod.MirroredStrategy,
            mod.get_replica_context,
            mod.PerReplica,
            mod.DistributedValues,
            reduce_op.SUM if reduce_op is not None else "sum",
            str(getattr(mod, "__version__", None) or dist_version("aioreplica")),
            getattr(mod, "list_devices", None),
        )
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def host_strategy(
    api: Api | str | None, n: int, impls: Sequence[str]
) -> tuple[Strategy | None, str]:
    """``MirroredStrategy(["cpu:0", ...])`` for N replicas when aioreplica is in ``impls`` and
    imported; else None. The second item is why creating it failed, or ""."""
    if "aioreplica" in impls and isinstance(api, Api):
        try:
            return api.strategy_cls([f"cpu:{i}" for i in range(n)]), ""
        except Exception as exc:
            return None, f"MirroredStrategy(N={n}): {type(exc).__name__}: {exc}"
    return None, ""


# --- event loops and timing ----------------------------------------------------------------


class Driver:
    """Runs coroutine functions on one kind of event loop (one asyncio loop, reused)."""

    def __init__(self, kind: str) -> None:
        self.kind, self._runner = kind, None if kind == "trio" else asyncio.Runner()
        if kind == "uvloop":
            import uvloop

            self._runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)

    def run(self, fn: Callable[[], Awaitable[T]]) -> T:
        if self._runner is not None:
            return self._runner.run(_await(fn))
        import trio

        return trio.run(_await, fn)

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()


async def _await(fn: Callable[[], Awaitable[T]]) -> T:
    return await fn()


async def within(seconds: float, aw: Awaitable[T]) -> T:
    try:
        with anyio.fail_after(seconds):
            return await aw
    except TimeoutError:
        raise TimeoutError(f"verification step did not finish within {seconds} s") from None


async def timed_async(step: Callable[[], Awaitable[object]], reps: int) -> int:
    t0 = time.perf_counter_ns()
    for _ in range(reps):
        await step()
    return time.perf_counter_ns() - t0


def timed_sync(step: Callable[[], object], reps: int) -> int:
    t0 = time.perf_counter_ns()
    for _ in range(reps):
        step()
    return time.perf_counter_ns() - t0


# --- cases and sampling --------------------------------------------------------------------


class Measured(Protocol):
    """A result row as the harness fills it in."""

    status: str  # ok | skipped | error
    reason: str
    reps: int
    samples_ns: list[int]

    @property
    def tolerates_failure(self) -> bool:
        """True when a failure is recorded on the row and the run goes on; else it raises."""
        ...

    @property
    def label(self) -> str:
        """The row in the line printed when it fails."""
        ...


R = TypeVar("R", bound=Measured)


@dataclass
class Case(Generic[R]):
    result: R
    sample: Callable[[int], int]  # reps -> elapsed ns
    verify: Callable[[], None]


def one_sample(case: Case[Any], reps: int, *, gc_off: bool) -> int:
    """One sample after ``gc.collect()``; with ``gc_off`` the collector is disabled during it."""
    gc.collect()
    if not gc_off:
        return case.sample(reps)
    gc.disable()
    try:
        return case.sample(reps)
    finally:
        gc.enable()


def calibrate(case: Case[Any], target_ns: int, *, max_reps: int, gc_off: bool) -> int:
    """The number of calls for one sample of ``case`` to last about ``target_ns``."""
    reps = 1
    while True:
        elapsed = max(one_sample(case, reps, gc_off=gc_off), 1)
        if elapsed >= target_ns // 5 or reps >= max_reps:
            return max(1, round(reps * target_ns / elapsed))
        reps = max(reps * 2, min(reps * 100, math.ceil(reps * target_ns / 2 / elapsed)))


def guard(case: Case[Any], action: Callable[[Case[Any]], object]) -> bool:
    """Run one harness action; a failure the row tolerates is recorded, any other raises."""
    try:
        action(case)
    except Exception as exc:
        r = case.result
        if not r.tolerates_failure:
            raise
        r.status, r.reason = "error", f"{type(exc).__name__}: {exc}"
        print(f"  {r.label} failed: {r.reason}", file=sys.stderr)
        return False
    return True


def run_interleaved(
    cases: list[Case[R]], samples: int, target_ns: int, *, max_reps: int, gc_off: bool
) -> None:
    """Verify and calibrate each case, then take ``samples`` samples of each, interleaved
    (A B C A B C ...); a case that fails is dropped from ``cases``."""

    def verify_and_calibrate(case: Case[Any]) -> None:
        case.verify()
        case.result.reps = calibrate(case, target_ns, max_reps=max_reps, gc_off=gc_off)

    def take_sample(case: Case[Any]) -> None:
        case.result.samples_ns.append(one_sample(case, case.result.reps, gc_off=gc_off))

    for c in list(cases):
        if not guard(c, verify_and_calibrate):
            cases.remove(c)
    for _ in range(samples):
        for c in list(cases):
            if not guard(c, take_sample):
                cases.remove(c)


def sample_target_ns(quick: bool) -> int:
    """How long one sample lasts: 0.05 s with ``--quick``, else 0.2 s."""
    return 50_000_000 if quick else 200_000_000


# --- command line and report ---------------------------------------------------------------


def bench_parser(doc: str | None, loop_help: str) -> argparse.ArgumentParser:
    """A parser described by the docstring's first line, with ``--quick`` and ``--loop``."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="0.05 s samples, 3 per configuration")
    p.add_argument(
        "--loop",
        choices=("asyncio", "uvloop", "trio"),
        default="asyncio",
        help=loop_help,
    )
    return p


def pick(p: argparse.ArgumentParser, flag: str, text: str, allowed: Sequence[str]) -> list[str]:
    """The names in the comma-separated ``text``, in the order of ``allowed``; else exit."""
    chosen = {s.strip() for s in text.split(",") if s.strip()}
    if not chosen or chosen - set(allowed):
        p.error(f"{flag} {text!r}: choose from {','.join(allowed)}")
    return [i for i in allowed if i in chosen]


def fmt(x: float | None, width: int = 0) -> str:
    if x is None:
        return "n/a".rjust(width)
    text = f"{x:.3g}" if abs(x) < 10 else f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.1f}"
    return text.rjust(width)


def print_checks(checks: list[dict[str, str]]) -> None:
    print()
    for c in checks:
        print(f"{c['status']}  {c['name']}: {c['detail']}")


def dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def dist_versions(names: Sequence[str] = VERSIONED) -> dict[str, str | None]:
    return {d: dist_version(d) for d in names}


def aioreplica_meta(loaded: Api | str) -> str:
    return loaded.version if isinstance(loaded, Api) else f"not importable: {loaded}"


def run_meta() -> dict[str, Any]:
    """The first keys of a benchmark's JSON metadata: when, and on what."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": sys.version,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` and say so, with the run's wall time (``doc["meta"]``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {path} ({doc['meta']['wall_s']} s)")
