"""Compare the benchmarks' ratios between two checkouts: does a change cost performance?

Runs ``bench_scheduler.py``, ``bench_collectives.py`` and ``bench_training.py`` on an old and a
new checkout, side by side, and compares every ratio they report. Each run is a subprocess of
this Python (``sys.executable``) running the checkout's own ``devices/bench_<name>.py`` with
``cwd`` and ``PYTHONPATH`` set to that checkout, so each imports its own ``aioreplica`` (checked
before the first run: ``aioreplica.__file__`` must lie inside the checkout). For each benchmark
the rounds alternate which checkout goes first (old new, new old, ...: ABBA), so a linear drift
of the machine's speed weighs on both alike. ``--quick`` is passed through.

Only ratios are compared, never absolute times: on a shared, noisy machine absolute times drift
between runs, while a ratio of two things timed moments apart in the same process holds. Each
run gives one value per ratio (the per-round ratio, computed as the benchmark computes it); the
value compared is the median of those per-round values over the rounds, for old and for new
(with 2 rounds, their mean). Not the best: a ratio is not a time that noise only ever makes
worse, noise moves it either way, and the best of a few would pick whichever side had the
luckiest outlier. ``change`` is new / old - 1.

Ratios compared (``lower``: lower is better; ``higher``: higher is better; ``info``: a pure
baseline with no aioreplica code in it, shown for the machine's state, never flagged):

scheduler    ``aio/floor marginal`` per N (lower) and ``threads/aio marginal`` per N (higher):
             Table 2, from ``marginal_us_per_round_per_replica`` (the JSON holds no ratio, so
             they are derived here as the benchmark prints them); ``aio/floor step`` per (N, k)
             (lower): aioreplica's over the floor's best µs per step, from ``results``; and,
             where a run has them, ``aio/floor marginal <kind>`` per N (lower) for merge calls
             with per-replica arguments (``marginal_by_args``: scalar, array, dict3).
collectives  ``aioreplica_over_fastest_numpy``, ``kernel2t_over_fastest_numpy`` and
             ``kernel1t_over_fastest_numpy`` per (N, MiB) (lower, ``allreduce_table``);
             ``ratio_2_over_1`` per implementation (``compute_table``; higher for aioreplica,
             info for threads); on a GPU, ``aioreplica_over_cupy_sum`` (lower) and
             ``aioreplica_bandwidth_over_copy`` (higher) per (N, MiB) (``gpu_allreduce_table``).
training     ``ratio`` (apply_gradients / hand merge) per (model, replicas) (lower,
             ``optimizer_step``); ``save/numpy save`` and ``restore/load`` (lower, derived from
             ``checkpoint_s``); ``x 1 thread`` (steps/s over plain NumPy's on one BLAS thread,
             derived from ``steps_per_second``: higher for the replica rows, info for plain
             NumPy on every BLAS thread).

A ratio that is missing or not a finite number > 0 in a run (not measured, or a marginal that
noise made <= 0) counts as missing for that round. Flags: ``WORSE`` when the change exceeds the
threshold (``--threshold``, 10 %) in the bad direction, ``better`` beyond it in the good one,
``MISSING`` when one checkout has the ratio and the other has it in no round. ``spread`` is the
largest (max - min) / median over the rounds of either checkout (n/a with one round): a flag
gets `` (noise)`` when the change is no larger than that spread, i.e. the same checkout moved as
much from round to round. ``--quick`` runs are too short for a 10 % bar (comparing a checkout
with itself flags several ratios, mostly as noise): judge on full runs, 2 rounds or more. The
checks each benchmark prints (PASS / FAIL) are listed per round as well.

Run from the repository root (the new checkout), with the project's virtualenv::

    .venv/bin/python devices/compare_checkouts.py --old /tmp/base --new . --quick
    .venv/bin/python devices/compare_checkouts.py --old /tmp/base --new . \\
        --bench scheduler collectives training --rounds 2 --json bench-results/compare.json
    .venv/bin/python devices/compare_checkouts.py --old /tmp/base --new . --bench collectives \\
        --bench-args "collectives=--n 4 --sizes 64 --part a"

Progress goes to stderr (the benchmarks' own progress lines with it); each benchmark's table
goes to a log next to its JSON in a temporary directory (``--keep DIR`` keeps both). The table
goes to stdout and, with ``--json``, to a JSON file with every per-round value and run. The exit
status is 0 whatever the comparison says; 2 when a checkout cannot import its aioreplica; 3 when
a benchmark run crashed or timed out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

BENCHES = ("scheduler", "collectives", "training")
SIDES = ("old", "new")
Direction = Literal["lower", "higher", "info"]
LOG_TAIL_LINES = 30


# --- the ratios in each benchmark's JSON ------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    """One ratio of one row, from one run."""

    row: str
    ratio: str
    direction: Direction
    value: float | None
    basis: str = ""  # what the ratio was taken against, where a run chooses it


def _ok(x: Any) -> float | None:
    """``x`` as a float when it is a finite number > 0; else None."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) and x > 0 else None


def _div(a: Any, b: Any) -> float | None:
    fa, fb = _ok(a), _ok(b)
    return None if fa is None or fb is None else fa / fb


def scheduler_metrics(doc: dict[str, Any]) -> list[Metric]:
    """Table 2's ``aio/floor`` and ``threads/aio`` per N; aio/floor per (N, k) step."""
    out: list[Metric] = []
    for n, m in doc["marginal_us_per_round_per_replica"].items():
        row = f"N={n}"
        out.append(
            Metric(row, "aio/floor marginal", "lower", _div(m.get("aioreplica"), m.get("floor")))
        )
        out.append(
            Metric(
                row, "threads/aio marginal", "higher", _div(m.get("threads"), m.get("aioreplica"))
            )
        )
    for kind, by_n in doc.get("marginal_by_args", {}).items():
        if kind == "none":  # the rows above
            continue
        for n, m in by_n.items():
            out.append(
                Metric(
                    f"N={n}",
                    f"aio/floor marginal {kind}",
                    "lower",
                    _div(m.get("aioreplica"), m.get("floor")),
                )
            )
    best = {(r["impl"], r["n"], r["k"]): r.get("best_us_per_step") for r in doc["results"]}
    for (impl, n, k), t in best.items():
        if impl == "aioreplica":
            floor = best.get(("floor", n, k))
            out.append(Metric(f"N={n} k={k}", "aio/floor step", "lower", _div(t, floor)))
    return out


def collectives_metrics(doc: dict[str, Any]) -> list[Metric]:
    """Tables 1-3: all_reduce against the fastest NumPy, 2/1 replicas, GPU against CuPy."""
    out: list[Metric] = []
    for t in doc.get("allreduce_table", []):
        row, basis = f"host N={t['n']} MiB={t['mib_per_replica']}", t.get("fastest_numpy") or ""
        names = (
            "aioreplica_over_fastest_numpy",
            "kernel2t_over_fastest_numpy",
            "kernel1t_over_fastest_numpy",
        )
        out += [Metric(row, name, "lower", _ok(t[name]), basis) for name in names if name in t]
    for impl, c in doc.get("compute_table", {}).items():
        direction: Direction = "higher" if impl == "aioreplica" else "info"
        out.append(Metric(f"compute {impl}", "ratio_2_over_1", direction, _ok(c["ratio_2_over_1"])))
    for t in doc.get("gpu_allreduce_table", []):
        row = f"gpu N={t['n']} MiB={t['mib_per_replica']}"
        out.append(
            Metric(row, "aioreplica_over_cupy_sum", "lower", _ok(t["aioreplica_over_cupy_sum"]))
        )
        out.append(
            Metric(
                row,
                "aioreplica_bandwidth_over_copy",
                "higher",
                _ok(t["aioreplica_bandwidth_over_copy"]),
            )
        )
    return out


def training_metrics(doc: dict[str, Any]) -> list[Metric]:
    """Tables A-C: apply_gradients / hand merge, checkpoint / NumPy, steps/s over 1 thread."""
    out = [
        Metric(f"optimizer {r['model']} N={r['replicas']}", "ratio", "lower", _ok(r["ratio"]))
        for r in doc["optimizer_step"]
    ]
    ckpt = doc["checkpoint_s"]
    for action, baseline in (("save", "numpy save"), ("restore", "load")):
        ratio = _div(ckpt.get(action), ckpt.get(baseline))
        out.append(Metric(f"checkpoint {action}", f"{action}/{baseline}", "lower", ratio))
    rates = doc["steps_per_second"]
    single_key = "plain NumPy, 1 BLAS thread"
    for name, rate in rates.items():
        if name != single_key:
            direction: Direction = "higher" if "replica" in name else "info"
            out.append(Metric(name, "x 1 thread", direction, _div(rate, rates.get(single_key))))
    return out


EXTRACTORS: dict[str, Callable[[dict[str, Any]], list[Metric]]] = {
    "scheduler": scheduler_metrics,
    "collectives": collectives_metrics,
    "training": training_metrics,
}


# --- running the benchmarks -------------------------------------------------------------------


@dataclass
class Run:
    bench: str
    round: int
    side: str
    checkout: Path
    json_path: Path
    log_path: Path
    rc: int | None = None
    seconds: float = 0.0
    doc: dict[str, Any] | None = None
    error: str = ""


def _env(checkout: Path) -> dict[str, str]:
    """This environment with PYTHONPATH = the checkout alone (nothing of the other one)."""
    return os.environ | {"PYTHONPATH": str(checkout), "PYTHONUNBUFFERED": "1"}


def aioreplica_file(checkout: Path) -> str:
    """``aioreplica.__file__`` as a run in ``checkout`` imports it; exits 2 when it is not
    importable or comes from elsewhere."""
    proc = subprocess.run(
        [sys.executable, "-c", "import aioreplica; print(aioreplica.__file__)"],
        cwd=checkout,
        env=_env(checkout),
        capture_output=True,
        text=True,
        check=False,
    )
    where = proc.stdout.strip()
    why = ""
    if proc.returncode != 0:
        why = f"cannot import aioreplica:\n{proc.stderr.strip()}"
    elif not Path(where).resolve().is_relative_to(checkout):
        why = f"aioreplica is imported from {where}, not from this checkout"
    if why:
        print(f"{checkout}: {why}", file=sys.stderr)
        raise SystemExit(2)
    return where


def run_one(run: Run, quick: bool, extra: Sequence[str], timeout: float, quiet: bool) -> None:
    script = run.checkout / "devices" / f"bench_{run.bench}.py"
    cmd = [sys.executable, str(script), "--json", str(run.json_path)]
    cmd += ["--quick"] if quick else []
    cmd += extra
    t0 = time.perf_counter()
    with run.log_path.open("w") as log:
        log.write(f"$ cd {run.checkout} && PYTHONPATH={run.checkout} {shlex.join(cmd)}\n")
        log.flush()
        try:
            proc = subprocess.run(
                cmd,
                cwd=run.checkout,
                env=_env(run.checkout),
                stdout=log,
                stderr=log if quiet else None,
                timeout=timeout,
                check=False,
            )
            run.rc = proc.returncode
        except subprocess.TimeoutExpired:
            run.rc, run.error = 124, f"timed out after {timeout:.0f} s"
    run.seconds = time.perf_counter() - t0
    if run.rc == 0:
        try:
            run.doc = json.loads(run.json_path.read_text())
        except (OSError, ValueError) as exc:
            run.error = f"no JSON: {type(exc).__name__}: {exc}"
    elif not run.error:
        run.error = f"exit status {run.rc}"


def _log_tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join("    " + s for s in lines[-LOG_TAIL_LINES:])


# --- comparison -------------------------------------------------------------------------------


@dataclass
class Compared:
    bench: str
    row: str
    ratio: str
    direction: Direction
    rounds: dict[str, list[float | None]] = field(
        default_factory=lambda: {side: [] for side in SIDES}
    )
    bases: set[str] = field(default_factory=set)

    def median(self, side: str) -> float | None:
        values = [v for v in self.rounds[side] if v is not None]
        return statistics.median(values) if values else None

    @property
    def change(self) -> float | None:
        old, new = self.median("old"), self.median("new")
        return None if old is None or new is None else new / old - 1

    @property
    def spread(self) -> float | None:
        """The largest (max - min) / median over the rounds of either checkout."""
        spreads = []
        for side in SIDES:
            values = [v for v in self.rounds[side] if v is not None]
            if len(values) > 1:
                spreads.append((max(values) - min(values)) / statistics.median(values))
        return max(spreads, default=None)

    def flag(self, threshold: float) -> str:
        old, new, change = self.median("old"), self.median("new"), self.change
        if (old is None) != (new is None):
            return "MISSING"
        if change is None or self.direction == "info":
            return ""
        worse = change > threshold if self.direction == "lower" else change < -threshold
        better = change < -threshold if self.direction == "lower" else change > threshold
        flag = "WORSE" if worse else "better" if better else ""
        spread = self.spread
        if flag and spread is not None and abs(change) <= spread:
            flag += " (noise)"
        return flag


def compare(runs: list[Run]) -> list[Compared]:
    """One entry per (bench, row, ratio), in the order the runs report them; rows that no run
    measured on either side are left out."""
    table: dict[tuple[str, str, str], Compared] = {}
    for run in runs:
        if run.doc is None:
            continue
        for m in EXTRACTORS[run.bench](run.doc):
            key = (run.bench, m.row, m.ratio)
            c = table.setdefault(key, Compared(run.bench, m.row, m.ratio, m.direction))
            c.rounds[run.side].append(m.value)
            if m.basis:
                c.bases.add(m.basis)
    return [c for c in table.values() if c.median("old") is not None or c.median("new") is not None]


def compare_checks(runs: list[Run]) -> list[dict[str, Any]]:
    """Each benchmark's checks: their statuses per round, for old and for new."""
    checks: dict[tuple[str, str], dict[str, Any]] = {}
    for run in runs:
        for c in (run.doc or {}).get("checks", []):
            entry = checks.setdefault(
                (run.bench, c["name"]),
                {"bench": run.bench, "name": c["name"], "old": [], "new": []},
            )
            entry[run.side].append(c["status"])
    return list(checks.values())


def _num(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}%"


def print_table(compared: list[Compared], checks: list[dict[str, Any]], threshold: float) -> None:
    heads = ("bench", "row", "ratio", "better", "old", "new", "change", "spread", "flag")
    lines = [
        (
            c.bench,
            c.row,
            c.ratio,
            c.direction,
            _num(c.median("old")),
            _num(c.median("new")),
            _pct(c.change),
            "n/a" if c.spread is None else f"{c.spread * 100:.0f}%",
            c.flag(threshold),
        )
        for c in compared
    ]
    widths = [max(len(s) for s in col) for col in zip(heads, *lines, strict=True)]
    left = 3  # bench, row and ratio are left-aligned; the rest right-aligned

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            s.ljust(w) if i < left else s.rjust(w)
            for i, (s, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    print(
        f"\nRatios, median over the rounds of the per-round ratio; change = new / old - 1; "
        f"flag: beyond ±{threshold * 100:g} %"
    )
    print(line(heads))
    for cells in lines:
        print(line(cells))
    mixed = [c for c in compared if len(c.bases) > 1]
    for m in mixed:
        print(f"  note: {m.bench} {m.row} {m.ratio}: baseline differed between runs: {m.bases}")
    flags = [c.flag(threshold) for c in compared]
    worse, noisy = flags.count("WORSE"), flags.count("WORSE (noise)")
    print(
        f"\n{len(compared)} ratios: {worse} WORSE beyond ±{threshold * 100:g} % and beyond the "
        f"spread of the rounds, {noisy} more within that spread, {flags.count('MISSING')} MISSING"
    )
    if checks:
        print("\nChecks, per round (old | new):")
        for check in checks:
            old, new = " ".join(check["old"]), " ".join(check["new"])
            print(f"  {check['bench']} {check['name']}: {old} | {new}")


# --- command line -----------------------------------------------------------------------------


def _bench_args(p: argparse.ArgumentParser, items: Sequence[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items:
        bench, sep, text = item.partition("=")
        if not sep or bench not in BENCHES:
            p.error(f"--bench-args {item!r}: expected BENCH=ARGS, BENCH in {', '.join(BENCHES)}")
        out[bench] = out.get(bench, []) + shlex.split(text)
    return out


def _checkout(p: argparse.ArgumentParser, path: Path, benches: Sequence[str]) -> Path:
    root = path.resolve()
    for bench in benches:
        if not (root / "devices" / f"bench_{bench}.py").is_file():
            p.error(f"{root}: no devices/bench_{bench}.py")
    return root


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--old", type=Path, required=True, help="the old checkout (the reference)")
    p.add_argument("--new", type=Path, default=Path(), help="the new checkout (default: .)")
    p.add_argument("--bench", nargs="+", choices=BENCHES, default=list(BENCHES))
    p.add_argument("--rounds", type=int, default=2, help="runs per checkout and benchmark")
    p.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    p.add_argument(
        "--bench-args",
        action="append",
        default=[],
        metavar="BENCH=ARGS",
        help='more arguments for one benchmark, e.g. "collectives=--n 4 --sizes 64"',
    )
    p.add_argument("--threshold", type=float, default=10.0, help="flag beyond this %% change")
    p.add_argument("--timeout", type=float, help="seconds per run (default 600, 300 quick)")
    p.add_argument("--keep", type=Path, help="keep each run's JSON and log in this directory")
    p.add_argument("--quiet", action="store_true", help="the benchmarks' stderr to their logs")
    p.add_argument("--json", type=Path, help="write the comparison here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    benches = [b for b in BENCHES if b in args.bench]
    extra = _bench_args(p, args.bench_args)
    roots = {"old": _checkout(p, args.old, benches), "new": _checkout(p, args.new, benches)}
    timeout = args.timeout or (300.0 if args.quick else 600.0)

    imported = {side: aioreplica_file(root) for side, root in roots.items()}
    for side in SIDES:
        print(f"{side}: {roots[side]} (aioreplica: {imported[side]})", file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="compare_checkouts-") as tmp:
        out_dir = args.keep.resolve() if args.keep else Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        runs: list[Run] = []
        for bench in benches:
            for r in range(args.rounds):
                for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                    stem = f"{bench}-r{r + 1}-{side}"
                    runs.append(
                        Run(
                            bench,
                            r + 1,
                            side,
                            roots[side],
                            out_dir / f"{stem}.json",
                            out_dir / f"{stem}.log",
                        )
                    )
        t0 = time.perf_counter()
        for i, run in enumerate(runs, 1):
            print(
                f"\n[{i}/{len(runs)}] {run.bench} round {run.round}/{args.rounds} {run.side} "
                f"({run.checkout}), {time.perf_counter() - t0:.0f} s so far",
                file=sys.stderr,
                flush=True,
            )
            run_one(run, args.quick, extra.get(run.bench, []), timeout, args.quiet)
            if run.error:
                status = f"FAILED in {run.seconds:.0f} s ({run.error}); the end of its log:"
            else:
                status = f"done in {run.seconds:.0f} s"
            print(f"  {status}", file=sys.stderr, flush=True)
            if run.error:
                print(_log_tail(run.log_path), file=sys.stderr)
        total_s = time.perf_counter() - t0

    compared = compare(runs)
    checks = compare_checks(runs)
    threshold = args.threshold / 100
    print_table(compared, checks, threshold)
    failed = [r for r in runs if r.error]
    for f in failed:
        print(f"  run failed: {f.bench} round {f.round} {f.side}: {f.error}")
    print(f"\n{len(runs)} runs in {total_s:.0f} s")

    if args.json:
        doc = {
            "meta": {
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "python": sys.executable,
                "cpu_count": os.cpu_count(),
                "checkouts": {side: str(roots[side]) for side in SIDES},
                "aioreplica_file": imported,
                "benches": benches,
                "rounds": args.rounds,
                "quick": args.quick,
                "bench_args": extra,
                "threshold_pct": args.threshold,
                "statistic": "median over rounds of the per-round ratio",
                "wall_s": round(total_s, 1),
                "runs": [
                    {
                        "bench": r.bench,
                        "round": r.round,
                        "side": r.side,
                        "seconds": round(r.seconds, 1),
                        "rc": r.rc,
                        "error": r.error,
                        "bench_wall_s": (r.doc or {}).get("meta", {}).get("wall_s"),
                    }
                    for r in runs
                ],
            },
            "ratios": [
                {
                    "bench": c.bench,
                    "row": c.row,
                    "ratio": c.ratio,
                    "better": c.direction,
                    "old": c.median("old"),
                    "new": c.median("new"),
                    "change_pct": None if c.change is None else round(c.change * 100, 2),
                    "spread_pct": None if c.spread is None else round(c.spread * 100, 2),
                    "flag": c.flag(threshold),
                    "old_rounds": c.rounds["old"],
                    "new_rounds": c.rounds["new"],
                    "baselines": sorted(c.bases),
                }
                for c in compared
            ],
            "checks": checks,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
