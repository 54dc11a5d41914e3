"""``devices/bench_multiworker.py --quick`` under ``mpiexec -n 2``: the shape of what it reports.

Timings are not judged here (they belong in the benchmark's tables): the run must end with
status 0, print both tables with a row for every configuration, and write JSON whose rows were
all measured (raw mpi4py and aioreplica's ``MultiWorkerMirroredStrategy``), with a status for
every check. Skipped without mpi4py or without the ``mpiexec`` next to this Python (the
``mpi`` extra brings both).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py")

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "devices" / "bench_multiworker.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
QUICK_SIZES = ("8 B", "1 MiB", "16 MiB")
#: The bench's own deadline (every rank ends itself), below Hydra's and this test's limits.
DEADLINE_S = 100
LAUNCH = [str(MPIEXEC), "-iface", "lo", "-n", "2", sys.executable]


@pytest.mark.timeout(180)
def test_quick_run_reports_every_configuration(tmp_path: Path) -> None:
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec next to {sys.executable}")
    out = tmp_path / "bench_multiworker.json"
    env = os.environ | {"UCX_NET_DEVICES": "lo", "MPIEXEC_TIMEOUT": str(DEADLINE_S + 20)}
    # The bench's --deadline ends every rank by itself: Hydra puts each rank in a session of
    # its own, so killing mpiexec on a timeout would leave them running.
    proc = subprocess.run(
        [*LAUNCH, str(BENCH), "--quick", "--json", str(out), "--deadline", str(DEADLINE_S)],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S + 40,
        env=env,
        cwd=REPO,
        check=False,
    )
    report = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report

    # Table 1: a row per local replica count and size, each with both ratios (all rows ran).
    rows = re.findall(
        r"^\s*([12])\s+(8 B|\d+ MiB) (?:Allreduce|np\.add)[^\n]*?\s(\S+)\s+(\S+)\s+"
        r"(info|PASS|FAIL)\s+(\S+)\s+(\S+)$",
        proc.stdout,
        re.MULTILINE,
    )
    assert [(local, size) for local, size, *_ in rows] == [
        (local, size) for local in "12" for size in QUICK_SIZES
    ], report
    for _local, _size, ratio, _bar, _status, poll, vs_poll in rows:
        assert "n/a" not in (ratio, poll, vs_poll), report
    # Table 2 and the checks: the 8-byte step for 1 and 2 local replicas; 4 ratio checks.
    assert "Table 2" in proc.stdout, report
    checks = re.findall(r"^(PASS|FAIL|SKIP)  \((\d)\) ", proc.stdout, re.MULTILINE)
    assert [n for _, n in checks] == ["1"] * 4 + ["2"] * 2, report

    doc = json.loads(out.read_text())
    meta = doc["meta"]
    assert meta["workers"] == 2, meta
    assert meta["quick"] is True
    assert meta["local_replicas"] == [1, 2]
    assert not meta["aioreplica"].startswith("not measured"), meta["aioreplica"]
    # Every row measured: both baselines and aioreplica at every size, the one-process step
    # at 8 B, alone and in lockstep.
    expected = {
        (impl, local, nbytes)
        for local in (1, 2)
        for nbytes in meta["sizes_bytes"]
        for impl in ("raw", "raw-poll", "aioreplica", "mirrored", "lockstep")
        if impl not in ("mirrored", "lockstep") or nbytes == 8
    }
    assert {(r["impl"], r["local_replicas"], r["nbytes"]) for r in doc["rows"]} == expected
    assert (meta["samples"], meta["step_samples"]) == (3, 9), meta
    for r in doc["rows"]:
        assert r["status"] == "ok", r
        assert r["reps"] >= 1, r
        step = r["nbytes"] == 8
        assert len(r["samples_ns"]) == meta["step_samples" if step else "samples"], r
        assert all(s > 0 for s in r["samples_ns"]), r
    assert len(doc["throughput"]) == 6
    for t in doc["throughput"]:
        assert min(t["raw_mb_s"], t["aioreplica_mb_s"], t["ratio"]) > 0, t
        assert min(t["raw_poll_mb_s"], t["ratio_vs_poll"]) > 0, t
        assert t["status"] in (("info",) if t["bar"] is None else ("PASS", "FAIL")), t
    assert [t["local_replicas"] for t in doc["added_8b"]] == [1, 2]
    for t in doc["added_8b"]:
        assert min(t["multiworker_us_best"], t["mirrored_us_best"], t["lockstep_us_best"]) > 0, t
        assert t["lockstep_added_us"] is not None, t
        assert t["status"] in ("PASS", "FAIL"), t
    statuses = {c["status"] for c in doc["checks"]}
    assert statuses <= {"PASS", "FAIL", "SKIP"}, doc["checks"]
    # --quick leaves out 64 MiB: exactly those two ratio checks are SKIP.
    assert [c["status"] == "SKIP" for c in doc["checks"]] == [False, True] * 2 + [False] * 2
