"""``examples/train_digits.py --multi-worker`` under ``mpiexec``: 2 workers of 2 local replicas
each train as one process of 4 replicas does, on the same global batches.

The single-process run and the MPI job each run as their own programs (the job with the venv's
own ``mpiexec``, every socket on loopback), the chief writes the final parameters
(``--save-params``) and a checkpoint, and the test compares both runs' files. A job that hangs is
ended by the test itself: Hydra puts each rank in its own session, so the test kills every
process the job started, by id.
"""

from __future__ import annotations

import doctest
import functools
import io
import json
import os
import re
import sys
import zipfile
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest
from example_modules import EXAMPLES, load_example
from mpi_jobs import Job, mpiexec, run_job
from test_docs import DOCS, blocks, expected_output

if TYPE_CHECKING:
    from pathlib import Path

    from numpy.typing import NDArray

EXAMPLE = EXAMPLES / "train_digits.py"
#: Seconds a whole run may take before it is killed (the job's ranks included).
HARD_TIMEOUT = 50
STEPS = 20
#: The launch line of docs/multi-worker.md: 2 workers, loopback only; ``-m mpi4py`` ends the
#: job when a worker raises.
MPI_PYTHON = [*mpiexec(2), sys.executable, "-m", "mpi4py"]


def launch(command: list[str], cwd: Path) -> Job:
    """Run ``command`` to its end (``HARD_TIMEOUT`` at most); it must succeed."""
    job = run_job(command, timeout=HARD_TIMEOUT, cwd=cwd, env={"TMPDIR": str(cwd)})
    assert job.returncode == 0, f"{command}\n{job.log}"
    return job


def example(cwd: Path, launcher: list[str], *flags: str) -> Job:
    """``examples/train_digits.py`` with ``flags``, started by ``launcher`` in ``cwd``."""
    return launch([*launcher, str(EXAMPLE), *flags], cwd=cwd)


def train(tmp_path: Path, name: str, launcher: list[str], *flags: str) -> Job:
    """The example for ``STEPS`` steps with ``flags``, its checkpoints in ``tmp_path/name``,
    its final parameters in ``tmp_path/name.npz``; the default global batch (64)."""
    return example(
        tmp_path,
        launcher,
        *flags,
        "--max-steps",
        str(STEPS),
        "--checkpoint-dir",
        str(tmp_path / name),
        "--save-params",
        str(tmp_path / f"{name}.npz"),
    )


def parameters(path: Path) -> dict[str, NDArray[Any]]:
    with np.load(path, allow_pickle=False) as arrays:
        return {name: arrays[name] for name in arrays.files}


def checkpoint(path: Path) -> tuple[Any, dict[str, NDArray[Any]]]:
    """A checkpoint's manifest and its arrays by member name."""
    manifest, arrays = None, {}
    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            data = archive.read(member)
            if member.endswith(".npy"):
                arrays[member] = np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
            else:
                manifest = json.loads(data)
    return manifest, arrays


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The single-process run with 4 replicas: its folder and what it printed."""
    folder = tmp_path_factory.mktemp("single")
    completed = train(folder, "run", [sys.executable], "--replicas", "4")
    return folder, completed.stdout


class TestMultiWorker:
    @pytest.mark.timeout(2 * HARD_TIMEOUT + 10)
    def test_two_workers_of_two_replicas_reach_the_four_replica_parameters(
        self, tmp_path: Path, single: tuple[Path, str]
    ) -> None:
        """``mpiexec -n 2 ... --multi-worker --replicas 2`` ends, after 20 steps of the same
        global batches, with the parameters of one process with 4 replicas (rtol 1e-6); only
        the chief reports and writes, and its checkpoint holds what the single process's
        does."""
        folder, printed = single
        multi = train(tmp_path, "run", MPI_PYTHON, "--multi-worker", "--replicas", "2")

        ours = parameters(tmp_path / "run.npz")
        theirs = parameters(folder / "run.npz")
        assert sorted(ours) == sorted(theirs) == ["b1", "b2", "w1", "w2"]
        initial = load_example("train_digits").init_params(0)
        for name, value in theirs.items():
            assert ours[name].dtype == value.dtype == np.float64
            np.testing.assert_allclose(ours[name], value, rtol=1e-6, err_msg=name)
        assert np.abs(theirs["w2"] - initial["w2"]).max() > 0.05  # 20 steps did move them

        # One report for the job: the chief's, the same as the single process's.
        lines = multi.stdout.splitlines()
        assert lines[0] == f"checkpoints go to {tmp_path / 'run'}"
        assert [line for line in lines if line.startswith("checkpoints go to")] == lines[:1]
        done = [line for line in lines if re.match(r"\d+ replicas, ", line)]
        assert done == [line for line in printed.splitlines() if line.startswith("4 replicas, ")]
        assert done[0].startswith("4 replicas, 20 steps, test accuracy ")
        assert lines.count(f"parameters written to {tmp_path / 'run.npz'}") == 1
        assert multi.stderr.count("| 0/440 [") == 1  # the chief's progress bar alone

        # The chief wrote the one checkpoint (nothing left half-written); it is the file the
        # single process writes, to rtol 1e-6: model, optimizer and place in the data.
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["ckpt-1.npz"]
        manifest, arrays = checkpoint(tmp_path / "run" / "ckpt-1.npz")
        manifest_single, arrays_single = checkpoint(folder / "run" / "ckpt-1.npz")
        assert manifest == manifest_single
        assert sorted(arrays) == sorted(arrays_single)
        for member, value in arrays_single.items():
            np.testing.assert_allclose(arrays[member], value, rtol=1e-6, err_msg=member)

    @pytest.mark.timeout(HARD_TIMEOUT + 10)
    def test_steps_per_call_takes_the_same_steps(
        self, tmp_path: Path, single: tuple[Path, str]
    ) -> None:
        """``--steps-per-call 8`` (``strategy.run_steps``) on 2 workers reaches the
        parameters of the single process's ``run()`` per step."""
        folder, _ = single
        multi_worker = ("--multi-worker", "--replicas", "2", "--steps-per-call", "8")
        train(tmp_path, "run", MPI_PYTHON, *multi_worker)
        ours = parameters(tmp_path / "run.npz")
        for name, value in parameters(folder / "run.npz").items():
            np.testing.assert_allclose(ours[name], value, rtol=1e-6, err_msg=name)


class TestResume:
    @pytest.mark.timeout(2 * HARD_TIMEOUT + 10)
    def test_a_job_resumed_mid_epoch_ends_as_one_unbroken_process(self, tmp_path: Path) -> None:
        """A job stopped 8 steps into the second epoch and resumed by a new job on trio (every
        worker restores the chief's checkpoint) ends with the parameters of one process with 4
        replicas that trained 2 epochs straight; the numbering and pruning of the checkpoints
        are the chief's (``max_to_keep=3``)."""
        flags = ("--multi-worker", "--replicas", "2", "--epochs", "2", "--checkpoint-dir", "ck")
        first = example(
            tmp_path, MPI_PYTHON, *flags, "--max-steps", "30", "--checkpoint-every", "10"
        )
        assert "4 replicas, 30 steps, test accuracy " in first.stdout
        # Saves at steps 10 and 20, at the end of epoch 1 (22 steps), at the stop (30).
        assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-2.npz", "ckpt-3.npz", "ckpt-4.npz"]
        resumed = example(
            tmp_path, MPI_PYTHON, *flags, "--resume", "--save-params", "end.npz", "--loop", "trio"
        )
        lines = resumed.stdout.splitlines()
        assert lines[:2] == [
            "checkpoints go to ck",
            f"resumed from {os.path.join('ck', 'ckpt-4.npz')} (epoch 1, step 30)",
        ]
        assert sum(line.startswith("4 replicas, 14 steps, ") for line in lines) == 1
        assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-3.npz", "ckpt-4.npz", "ckpt-5.npz"]

        digits = load_example("train_digits")
        straight = anyio.run(functools.partial(digits.main, 4, epochs=2, progress=False))
        assert straight.steps == 44
        ours = parameters(tmp_path / "end.npz")
        for name, value in straight.params.items():
            np.testing.assert_allclose(ours[name], value, rtol=1e-6, err_msg=name)


class TestGuide:
    @pytest.mark.timeout(HARD_TIMEOUT + 10)
    def test_the_guides_program_prints_the_same_on_two_workers(self, tmp_path: Path) -> None:
        """The program of docs/multi-worker.md, which the docs suite runs as one worker,
        prints what its closing comments show under ``mpiexec -n 2`` too: once."""
        (block,) = [
            block
            for block in blocks(DOCS / "multi-worker.md")
            if "MultiWorkerMirroredStrategy(" in block.code and block.not_run is None
        ]
        (tmp_path / "fit.py").write_text(block.code)
        completed = launch([*MPI_PYTHON, "fit.py"], cwd=tmp_path)
        expected = expected_output(block.code)
        assert expected is not None
        flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        assert doctest.OutputChecker().check_output(expected, completed.stdout, flags), (
            f"under mpiexec -n 2 it printed\n{completed.stdout}but its closing comments show\n"
            f"{expected}"
        )
