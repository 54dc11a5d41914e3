"""``devices/check_gpu.py`` and ``devices/run.sh`` against the CPU stand-in of CuPy.

The conformance check runs whole, in a subprocess with the stand-in (``tests/cupy_sim``) first
on ``PYTHONPATH``, on 1, 2 and 4 simulated GPUs and without NCCL; its race detector fails any
access to device memory that CUDA would not order. In-process runs (``simulated_cupy``) break
one thing at a time, a hanging ``synchronize()``, a hanging layout, a missing event wait, a host
sync inside a step, and make sure the check reports it. ``run.sh`` runs end to end, without a
git checkout, inside its time limit.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest
from simulated_gpus import simulated_cupy

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
SIM = REPO / "tests" / "cupy_sim"
CHECK = REPO / "devices" / "check_gpu.py"
RUN_SH = REPO / "devices" / "run.sh"
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed, (\d+) skipped in [\d.]+ s$", re.MULTILINE)
LOOPS = ["asyncio"] + (["trio"] if importlib.util.find_spec("trio") is not None else [])
#: One check of each part that must pass in every layout.
EVERY_PART = (
    "all_reduce sum float32",
    "all_reduce mean float16",
    "all_gather axis=1",
    "reduce_scatter max",
    "strategy.reduce mean axis=0 (uneven)",
    "replicas interleaved",
    "variables, made in scope(): mirrored mean",
    "variables, replica-context reads after writes",
    "variables, written in cross-replica context: on-read sum",
    "variables, written in cross-replica context: mirrored 0-d",
    "variables, cross-replica reads held on the GPU across later writes",
    "optimizer SGD (momentum) apply_gradients, g.T gradient",
    "optimizer Adam apply_gradients, g.T and strided gradients",
    "checkpoint save, change, restore: values back",
    "all_reduce of a .T and an x[:, ::2] among packed small leaves",
    "rounds of the same step, results dropped each round",
    "invariant 1: own device and stream at every await",
    "invariant 4: no host synchronization on the loop thread in a step (wrapped entry points)",
    "invariant 4: no host synchronization on the loop thread in a step "
    "(cupyx.allow_synchronize(False))",
    "no data race recorded by the stand-in",
)


def layout_labels(gpus: int) -> list[str]:
    if gpus == 1:
        return ["1 replica on gpu:0", "2 replicas on gpu:0", "4 replicas on gpu:0"]
    return [f"{gpus} replicas, one per GPU", f"{2 * gpus} replicas, 2 per GPU"]


def summary(output: str) -> tuple[int, int, int]:
    """``(passed, failed, skipped)`` from the check's last line."""
    found = SUMMARY.findall(output)
    assert found, f"no summary line in:\n{output[-3000:]}"
    passed, failed, skipped = found[-1]
    return int(passed), int(failed), int(skipped)


def run_check(gpus: int, *args: str, nccl: bool = True) -> subprocess.CompletedProcess[str]:
    """``check_gpu.py`` in a subprocess on the stand-in with ``gpus`` GPUs, warnings as errors."""
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(REPO), str(SIM)]),
        "CUPY_SIM_DEVICES": str(gpus),
        "CUPY_SIM_NCCL": "1" if nccl else "0",
    }
    return subprocess.run(
        [sys.executable, "-W", "error", str(CHECK), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


def passed_lines(output: str) -> set[str]:
    return {line.removeprefix("PASS ") for line in output.splitlines() if line.startswith("PASS ")}


def assert_every_part_passed(output: str, label: str) -> None:
    """Every part of the check passed in layout ``label`` (with its loop)."""
    passed = passed_lines(output)
    for part in EVERY_PART:
        assert any(line.startswith(f"[{label}] ") and part in line for line in passed), (
            f"no PASS for {part!r} in layout {label!r}"
        )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_every_layout_passes_on_simulated_gpus(gpus: int) -> None:
    result = run_check(gpus)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert summary(result.stdout)[1:] == (0, 0)
    assert "FAIL" not in output
    assert "16 x 16 float32" in result.stdout  # quick by itself against the stand-in
    for index in range(gpus):
        assert any(line.startswith(f"[smoke] gpu:{index} ") for line in passed_lines(output))
    for loop in LOOPS:
        for label in layout_labels(gpus):
            assert_every_part_passed(output, f"{label}, {loop}")


@pytest.mark.timeout(120)
def test_runs_without_trio_and_pytest_as_on_the_device_image() -> None:
    blocked = ("trio", "pytest", "pytest_asyncio", "uvloop")
    code = (
        "import runpy, sys\n"
        f"sys.modules.update(dict.fromkeys({blocked!r}))  # importing them raises ImportError\n"
        f"sys.argv = [{str(CHECK)!r}]\n"
        f"runpy.run_path({str(CHECK)!r}, run_name='__main__')\n"
    )
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(REPO), str(SIM)]),
        "CUPY_SIM_DEVICES": "1",
    }
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "trio is not installed: asyncio only" in output
    assert summary(result.stdout)[1:] == (0, 0)
    for label in layout_labels(1):
        assert_every_part_passed(output, f"{label}, asyncio")
    assert ", trio]" not in output


@pytest.mark.timeout(120)
def test_without_nccl_layouts_across_gpus_are_skipped_and_those_on_one_gpu_run() -> None:
    result = run_check(2, nccl=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert summary(result.stdout)[1:] == (0, 2 * len(LOOPS))
    for loop in LOOPS:
        for label in layout_labels(2):
            assert f"SKIP [{label}, {loop}]: collectives across GPUs need NCCL" in output
            assert f"[{label}, {loop}] " not in output.replace(f"SKIP [{label}, {loop}]", "")
        for label in layout_labels(1):
            assert_every_part_passed(output, f"{label}, {loop}")
    assert "PASS [no NCCL] a collective across GPUs raises an error naming NCCL" in output


@pytest.mark.timeout(200)
def test_run_sh_runs_end_to_end_without_git_inside_its_limit(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {
        key: value for key, value in os.environ.items() if key != "AIOREPLICA_RUN_UNDER_TIMEOUT"
    } | {
        "OUT": str(out),
        "PYTHON": sys.executable,
        "PYTHONPATH": str(SIM),  # run.sh puts the checkout first
        "CUPY_SIM_DEVICES": "2",
        "AIOREPLICA_RUN_QUICK": "1",
        "AIOREPLICA_RUN_TIMEOUT": "150",
        "GIT_DIR": str(tmp_path / "no-git"),  # as in a copied tree: git finds no repository
    }
    result = subprocess.run(
        ["bash", str(RUN_SH)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    steps = {}
    for line in (out / "summary.txt").read_text().splitlines():
        match = re.fullmatch(r"(\S+) exit=(\d+) seconds=(\d+)", line)
        assert match is not None, line
        steps[match[1]] = (int(match[2]), int(match[3]))
    # Quick: no bench_multiworker. The workers' check runs under the virtualenv's mpiexec.
    assert set(steps) == {
        "check_gpu",
        "check_gpu_multiworker",
        "test_cupy_gpu",
        "bench_collectives",
        "bench_scheduler",
    }
    assert all(status == 0 for status, _ in steps.values()), steps
    log = (out / "check_gpu.log").read_text()
    assert summary(log)[1] == 0
    assert "SKIP" not in log
    workers = (out / "check_gpu_multiworker.log").read_text()
    assert re.search(r"^all workers: \d+ passed, 0 failed, 0 skipped", workers, re.MULTILINE)
    assert " passed" in (out / "test_cupy_gpu.log").read_text()
    assert "git: unknown (not a git checkout)" in (out / "environment.txt").read_text()
    for name in ("bench_collectives.json", "bench_scheduler.json"):
        assert (out / name).stat().st_size > 0
    collectives = (out / "bench_collectives.log").read_text()
    assert "part C ran on the CPU stand-in of CuPy" in collectives


# -- in process: break one thing, and the check says so -----------------------------------


@pytest.fixture
def check_gpu() -> Iterator[ModuleType]:
    """A fresh copy of ``devices/check_gpu.py`` as a module."""
    name = "check_gpu_under_test"
    spec = importlib.util.spec_from_file_location(name, CHECK)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


@pytest.mark.timeout(60)
def test_extra_replica_device_is_a_whole_device(check_gpu: ModuleType) -> None:
    with simulated_cupy(1):
        import aioreplica
        from aioreplica._backends import Device
        from aioreplica._backends._cupy import CudaDevice, cuda_device

        extra = check_gpu.ExtraReplicaDevice(0, 1)
        is_a_device = isinstance(extra, Device)  # every member of the protocol is there
        assert is_a_device
        public = {name for name in dir(CudaDevice) if not name.startswith("_")}
        assert public <= set(dir(extra)), public - set(dir(extra))
        assert (extra.name, extra.kind, extra.index) == ("gpu:0.1", "gpu", 0)
        assert extra.stream is not cuda_device(0).stream  # a stream of its own

        strategy = aioreplica.MirroredStrategy([cuda_device(0), extra])

        async def step() -> Any:
            ctx = aioreplica.get_replica_context()
            assert ctx is not None
            device: Any = ctx.device
            x = device.asarray(np.arange(3.0) + ctx.replica_id_in_sync_group)
            doubled = await device.compute(x.nbytes, lambda: x * 2)
            await device.synchronize()
            return await device.run(lambda: doubled.device.id), doubled

        result = anyio.run(strategy.run, step)
        values = [aioreplica.select_replica(r, result) for r in range(2)]
        assert [gpu for gpu, _ in values] == [0, 0]
        assert [value.get().tolist() for _, value in values] == [[0, 2, 4], [2, 4, 6]]


@pytest.mark.timeout(60)
def test_a_hanging_synchronize_fails_at_once_with_the_summary(
    check_gpu: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with simulated_cupy(2):
        from aioreplica._backends._cupy import CudaDevice

        async def hang(self: Any) -> None:
            await anyio.sleep_forever()

        monkeypatch.setattr(CudaDevice, "synchronize", hang)
        monkeypatch.setattr(check_gpu, "SMOKE_TIMEOUT", 0.2)
        status = check_gpu.main(["--loop", "asyncio"])
    output = capsys.readouterr().out
    assert status == 1
    assert "FAIL [smoke] gpu:0 synchronize() after a small kernel, within 0.2 s: it hung" in output
    assert summary(output) == (0, 1, 0)
    assert "replicas" not in output.split("FAIL [smoke]")[1]  # no layout ran


@pytest.mark.timeout(60)
def test_a_layout_that_times_out_fails_by_name_and_the_next_layout_runs(
    check_gpu: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    original = check_gpu.check_collectives

    async def hang_in_the_first_layout(run: Any) -> None:
        if run.label.startswith("1 replica"):
            await anyio.sleep_forever()
        await original(run)

    monkeypatch.setattr(check_gpu, "check_collectives", hang_in_the_first_layout)
    with simulated_cupy(1):
        status = check_gpu.main(["--loop", "asyncio", "--layout-timeout", "3"])
    output = capsys.readouterr().out
    assert status == 1
    assert summary(output)[1] == 1
    assert "FAIL [1 replica on gpu:0, asyncio] finished within 3 s: timed out" in output
    for label in ("2 replicas on gpu:0", "4 replicas on gpu:0"):
        assert_every_part_passed(output, f"{label}, asyncio")


@pytest.mark.timeout(60)
def test_a_missing_event_wait_fails_the_layouts_that_need_it(
    check_gpu: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the fan-in (the leader's stream waiting for the other replicas' streams), the
    2- and 4-replica layouts on one GPU read unfinished inputs: races, named."""
    with simulated_cupy(1):
        from aioreplica._backends import _cupy

        monkeypatch.setattr(_cupy._Plan, "fan_in", lambda self: None)
        status = check_gpu.main(["--loop", "asyncio"])
    output = capsys.readouterr().out
    assert status == 1
    assert_every_part_passed(output, "1 replica on gpu:0, asyncio")
    for label in ("2 replicas on gpu:0", "4 replicas on gpu:0"):
        race = f"FAIL [{label}, asyncio] no data race recorded by the stand-in: data race"
        assert race in output
        assert f"FAIL [{label}, asyncio] collectives ran to the end" in output


@pytest.mark.timeout(60)
def test_a_host_sync_inside_a_step_fails_invariant_4_both_ways(
    check_gpu: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with simulated_cupy(1) as cupy:
        from aioreplica._backends._cupy import CudaDevice

        original = CudaDevice.synchronize

        async def blocking_synchronize(self: Any) -> None:
            cupy.cuda.Device(self.index).synchronize()  # a host wait on the loop thread
            await original(self)

        monkeypatch.setattr(CudaDevice, "synchronize", blocking_synchronize)
        status = check_gpu.main(["--loop", "asyncio"])
    output = capsys.readouterr().out
    assert status == 1
    for label in layout_labels(1):
        prefix = f"FAIL [{label}, asyncio] invariant 4: no host synchronization on the loop thread"
        assert f"{prefix} in a step (wrapped entry points): Device.synchronize" in output
        assert f"{prefix} in a step (cupyx.allow_synchronize(False)): collectives_step" in output
