"""``examples/train_digits.py`` on the command line: where its checkpoints go, and ``--resume``.

Every run names its checkpoint folder on start: a new one per run under the system's temporary
folder unless ``--checkpoint-dir`` names one, so runs never find each other's checkpoints.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from example_modules import EXAMPLES, load_example

EXAMPLE = EXAMPLES / "train_digits.py"
#: A short run: 2 replicas, 2 steps of 512 rows.
QUICK = ["--epochs", "1", "--batch-size", "512", "--replicas", "2"]


def train(*arguments: str, temp: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the example with ``temp`` as the system's temporary folder."""
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *arguments],
        capture_output=True,
        text=True,
        timeout=120,
        check=check,
        env={**os.environ, "TMPDIR": str(temp), "TEMP": str(temp), "TMP": str(temp)},
    )


def contents(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


class TestCheckpointFolder:
    @pytest.mark.timeout(120)
    def test_each_run_checkpoints_into_a_new_folder_it_names(self, tmp_path: Path) -> None:
        """Two runs without ``--checkpoint-dir`` each print a new folder under the temporary
        folder, with the command that continues the run, and write only there."""
        folders = []
        for _ in range(2):
            completed = train(*QUICK, temp=tmp_path)
            first_line = completed.stdout.splitlines()[0]
            match = re.fullmatch(
                r"checkpoints go to (\S+) \(continue with --checkpoint-dir (\S+) --resume\)",
                first_line,
            )
            assert match is not None, first_line
            assert match[1] == match[2]
            folder = Path(match[1])
            assert folder.parent == tmp_path
            assert folder.name.startswith("aioreplica-train-digits-")
            assert sorted(contents(folder)) == ["ckpt-1.npz"]
            folders.append(folder)
        assert folders[0] != folders[1]
        assert sorted(tmp_path.iterdir()) == sorted(folders)


class TestResume:
    @pytest.mark.timeout(60)
    def test_resume_without_a_folder_is_refused(self, tmp_path: Path) -> None:
        """``--resume`` alone has no run to continue: exit 2, saying what to pass, nothing
        made."""
        completed = train(*QUICK, "--resume", temp=tmp_path, check=False)
        assert completed.returncode == 2
        assert completed.stderr.splitlines()[-1] == (
            "train_digits.py: error: --resume needs --checkpoint-dir DIR: the folder the run "
            "to continue printed on start"
        )
        assert completed.stdout == ""
        assert list(tmp_path.iterdir()) == []

    @pytest.mark.timeout(120)
    def test_resume_of_a_finished_run_says_so_and_exits_0(self, tmp_path: Path) -> None:
        """A run writes into the folder ``--checkpoint-dir`` names (made if missing) and says
        so first; resuming it once it has done every epoch asked for says that training is
        already complete, trains no step, and leaves its checkpoints as they were."""
        folder = tmp_path / "runs" / "ck"
        first = train(*QUICK, "--checkpoint-dir", str(folder), temp=tmp_path)
        assert first.stdout.splitlines()[0] == f"checkpoints go to {folder}"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
        before = contents(folder)
        assert sorted(before) == ["ckpt-1.npz"]
        again = train(*QUICK, "--checkpoint-dir", str(folder), "--resume", temp=tmp_path)
        assert again.stdout.splitlines()[:4] == [
            f"checkpoints go to {folder}",
            f"resumed from {folder / 'ckpt-1.npz'} (epoch 1, step 2)",
            "training is already complete (step 2 of 2): nothing to do; ask for more with --epochs",
            again.stdout.splitlines()[3],
        ]
        assert again.stdout.splitlines()[3].startswith("2 replicas, 0 steps, test accuracy ")
        assert "training:" not in again.stderr  # no progress bar for no steps
        assert contents(folder) == before

    @pytest.mark.anyio
    async def test_resume_from_an_empty_folder_says_it_starts_over(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """``resume=True`` with no checkpoint in the folder says so and trains from step 0."""
        digits = load_example("train_digits")
        folder = tmp_path / "empty"
        result = await digits.main(
            2, epochs=1, global_batch=512, checkpoint_dir=str(folder), resume=True, max_steps=1
        )
        out = capsys.readouterr().out.splitlines()
        assert out[0] == f"no checkpoint in {folder} yet: training from the start"
        assert (result.first_epoch, result.steps) == (0, 1)
        assert sorted(contents(folder)) == ["ckpt-1.npz"]

    @pytest.mark.anyio
    async def test_resume_with_more_epochs_continues(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A finished run resumed with a larger ``epochs`` trains only the new epochs."""
        digits = load_example("train_digits")
        folder = str(tmp_path / "ck")
        await digits.main(2, epochs=1, global_batch=512, checkpoint_dir=folder, progress=False)
        done = await digits.main(2, epochs=1, global_batch=512, checkpoint_dir=folder, resume=True)
        more = await digits.main(
            2, epochs=2, global_batch=512, checkpoint_dir=folder, resume=True, progress=False
        )
        assert (done.steps, more.first_epoch, more.steps) == (0, 1, 2)
        out = capsys.readouterr().out
        assert "training is already complete (step 2 of 2)" in out
