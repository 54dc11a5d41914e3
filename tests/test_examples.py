"""The examples run, and do what they say."""

from __future__ import annotations

import functools
import subprocess
import sys
from typing import TYPE_CHECKING

import anyio
import numpy as np
import pytest
from example_modules import EXAMPLES, load_example

if TYPE_CHECKING:
    from pathlib import Path
    from types import ModuleType

    from numpy.typing import NDArray


class TestQuickstart:
    @pytest.mark.anyio
    async def test_recovers_the_true_weights(self) -> None:
        """Data-parallel training on 4 replicas finds the weights that made the data."""
        quickstart = load_example("quickstart")
        result = await quickstart.main(replicas=4, steps=60, rows=512, report=False)
        np.testing.assert_allclose(result.weights, quickstart.TRUE_WEIGHTS, atol=0.01)
        assert result.merges == 60

    @pytest.mark.anyio
    async def test_replica_count_does_not_change_the_result(self) -> None:
        """Averaging equal-sized shard gradients gives the same weights on 1 or 8 replicas."""
        quickstart = load_example("quickstart")
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


def plain_numpy_training(
    digits: ModuleType, steps: int, global_batch: int, learning_rate: float, momentum: float
) -> dict[str, NDArray[np.float64]]:
    """The example's training written with NumPy alone: same batches, same SGD with momentum."""
    x, y, _, _ = digits.load_data(0)
    params: dict[str, NDArray[np.float64]] = digits.init_params(0)
    velocity = {name: np.zeros_like(value) for name, value in params.items()}
    shuffle = np.random.default_rng(0)  # one generator for the run, a permutation per epoch
    done = 0
    while done < steps:
        order = shuffle.permutation(len(y))
        for start in range(0, len(y) - global_batch + 1, global_batch):
            rows = order[start : start + global_batch]
            _, grads = digits.loss_and_grads(np, params, x[rows], y[rows], global_batch)
            for name in params:
                velocity[name] = momentum * velocity[name] - learning_rate * grads[name]
                params[name] = params[name] + velocity[name]
            done += 1
            if done == steps:
                break
    return params


class TestTrainDigits:
    @pytest.mark.anyio
    async def test_replicas_and_plain_numpy_agree(self) -> None:
        """50 steps on 4 replicas, on 1 replica, and in plain NumPy give the same parameters."""
        digits = load_example("train_digits")
        settings = {"global_batch": 64, "learning_rate": 0.1, "momentum": 0.9}
        four = await digits.main(4, max_steps=50, progress=False, **settings)
        one = await digits.main(1, max_steps=50, progress=False, **settings)
        plain = plain_numpy_training(digits, 50, 64, 0.1, 0.9)
        assert four.steps == one.steps == 50
        for name, value in plain.items():
            assert value.dtype == np.float64
            np.testing.assert_allclose(four.params[name], one.params[name], rtol=0, atol=1e-10)
            np.testing.assert_allclose(four.params[name], value, rtol=0, atol=1e-10)
        # The parameters did move: 50 steps are not a no-op.
        assert np.abs(plain["w2"] - digits.init_params(0)["w2"]).max() > 0.05

    @pytest.mark.anyio
    async def test_resuming_continues_the_same_run(self, tmp_path: Path) -> None:
        """Two epochs, a restart from the checkpoint and a third equal three epochs straight."""
        digits = load_example("train_digits")
        directory = str(tmp_path / "checkpoints")
        first = await digits.main(3, epochs=2, checkpoint_dir=directory, progress=False)
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
            "ckpt-1.npz",
            "ckpt-2.npz",
        ]
        resumed = await digits.main(
            3, epochs=3, checkpoint_dir=directory, resume=True, progress=False
        )
        straight = await digits.main(3, epochs=3, progress=False)
        assert (first.first_epoch, resumed.first_epoch) == (0, 2)
        assert resumed.steps == straight.steps // 3
        for name, value in straight.params.items():
            np.testing.assert_array_equal(resumed.params[name], value)

    @pytest.mark.anyio
    async def test_resuming_mid_epoch_continues_the_same_run(self, tmp_path: Path) -> None:
        """A run stopped after 30 steps (8 into the second epoch) and resumed sees the batches
        of an unbroken run and ends with its parameters."""
        digits = load_example("train_digits")
        directory = str(tmp_path / "checkpoints")
        stopped = await digits.main(
            3, epochs=2, max_steps=30, checkpoint_dir=directory, progress=False
        )
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
            "ckpt-1.npz",
            "ckpt-2.npz",
        ]
        resumed = await digits.main(
            3, epochs=2, checkpoint_dir=directory, resume=True, progress=False
        )
        straight = await digits.main(3, epochs=2, progress=False)
        assert (stopped.steps, resumed.steps, straight.steps) == (30, 14, 44)
        assert resumed.first_epoch == 1
        assert stopped.losses + resumed.losses == straight.losses
        for name, value in straight.params.items():
            np.testing.assert_array_equal(resumed.params[name], value)

    @pytest.mark.anyio
    async def test_steps_per_call_runs_the_same_steps(self, tmp_path: Path) -> None:
        """``steps_per_call`` (``strategy.run_steps``) takes the steps ``run()`` per step takes,
        over an epoch boundary and a ``max_steps`` inside a call, checkpoints and resumes."""
        digits = load_example("train_digits")
        directory = str(tmp_path / "checkpoints")
        straight = await digits.main(3, epochs=2, progress=False)
        stopped = await digits.main(
            3, epochs=2, max_steps=30, checkpoint_dir=directory, progress=False, steps_per_call=8
        )
        resumed = await digits.main(
            3, epochs=2, checkpoint_dir=directory, resume=True, progress=False, steps_per_call=5
        )
        assert (stopped.steps, resumed.steps, straight.steps) == (30, 14, 44)
        np.testing.assert_allclose(
            stopped.losses + resumed.losses, straight.losses, rtol=1e-12, atol=0
        )
        for name, value in straight.params.items():
            np.testing.assert_array_equal(resumed.params[name], value)
        with pytest.raises(ValueError, match="steps_per_call must be >= 1"):
            await digits.main(1, max_steps=1, progress=False, steps_per_call=0)

    @pytest.mark.anyio
    @pytest.mark.parametrize("steps_per_call", [1, 7])
    async def test_a_run_killed_mid_epoch_resumes_from_its_last_checkpoint(
        self, tmp_path: Path, steps_per_call: int
    ) -> None:
        """``checkpoint_every`` saves mid-epoch; a run killed after step 25 (its stopping
        checkpoint deleted, as if it never came) resumes at step 20 and ends as an unbroken
        run."""
        digits = load_example("train_digits")
        directory = tmp_path / "checkpoints"
        settings = {"progress": False, "steps_per_call": steps_per_call}
        killed = await digits.main(
            3,
            epochs=2,
            max_steps=25,
            checkpoint_dir=str(directory),
            checkpoint_every=10,
            **settings,
        )
        assert killed.steps == 25
        assert sorted(p.name for p in directory.iterdir()) == [  # the newest 3 of 4
            "ckpt-2.npz",  # step 20 (ckpt-1: step 10)
            "ckpt-3.npz",  # step 22: the end of the first epoch
            "ckpt-4.npz",  # step 25, where max_steps stopped it
        ]
        (directory / "ckpt-4.npz").unlink()
        (directory / "ckpt-3.npz").unlink()
        resumed = await digits.main(
            3, epochs=2, checkpoint_dir=str(directory), resume=True, **settings
        )
        straight = await digits.main(3, epochs=2, progress=False)
        assert resumed.steps == 44 - 20
        assert killed.losses[:20] + resumed.losses == straight.losses
        for name, value in straight.params.items():
            np.testing.assert_array_equal(resumed.params[name], value)

    def test_reaches_95_percent_test_accuracy(self, tmp_path: Path) -> None:
        """The default run (4 replicas, 20 epochs) classifies at least 95 % of the test set."""
        digits = load_example("train_digits")
        result = anyio.run(
            functools.partial(digits.main, checkpoint_dir=str(tmp_path), progress=False)
        )
        assert result.test_accuracy >= 0.95
        assert result.losses[-1] < result.losses[0] / 10

    def test_runs_from_the_command_line(self, tmp_path: Path) -> None:
        """The command line trains, plots, checkpoints every epoch, and resumes."""
        plot = tmp_path / "loss.png"
        command = [
            sys.executable,
            str(EXAMPLES / "train_digits.py"),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--loop",
            "trio",
        ]
        first = subprocess.run(
            [*command, "--epochs", "1", "--plot", str(plot)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert "4 replicas, 22 steps, test accuracy" in first.stdout
        assert "training: 100%" in first.stderr  # the progress bar
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        again = subprocess.run(
            [*command, "--epochs", "2", "--resume"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert f"resumed from {tmp_path / 'ck' / 'ckpt-1.npz'} (epoch 1, step 22)" in again.stdout
        assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["ckpt-1.npz", "ckpt-2.npz"]
