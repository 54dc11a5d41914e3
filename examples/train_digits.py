"""Train a small neural network on handwritten digits, data-parallel over several replicas.

The model is a two-layer perceptron (64 inputs, 64 tanh units, 10 classes) written in plain
array code, with its own forward and backward pass, so it runs on NumPy or CuPy alike: each
replica uses its device's array module (``ctx.device.xp``). The data is scikit-learn's bundled
digits set (1797 8x8 images; no download).

Every step, ``distribute_dataset`` splits a global batch across the replicas; each replica
computes the gradients of its rows (its loss is scaled by the global batch size, so the
replicas' gradients sum to the batch's mean gradient) in its device's worker thread, and
``apply_gradients`` sums them across replicas in one packed all-reduce and updates every copy of
every variable. A checkpoint of the model, the optimizer and the place in the data is written
after every epoch (and where a run stops early) to the folder the run prints on start: a new one
per run under the system's temporary folder, or ``--checkpoint-dir DIR``. ``--checkpoint-dir DIR
--resume`` continues from the last checkpoint in DIR, in the middle of an epoch if that is
where it was, seeing the batches an unbroken run would see; when DIR's run has already done
every epoch asked for, it says so and exits.

``--multi-worker`` trains across processes, one worker each, under MPI's ``mpiexec`` (extra
``mpi``): a ``MultiWorkerMirroredStrategy`` over this worker's ``--replicas`` local replicas, the
same global batch (each worker takes its replicas' slices), and so the parameters of the
single-process run with as many replicas in all. Only the chief (worker 0) prints and writes
files; every worker takes part in each checkpoint save. ``--save-params FILE`` writes the final
parameters (NumPy ``.npz``).

Run it::

    python examples/train_digits.py                     # 4 host replicas, asyncio
    python examples/train_digits.py --replicas 8 --loop trio --plot loss.png
    python examples/train_digits.py --checkpoint-dir digits-run      # checkpoints there
    python examples/train_digits.py --checkpoint-dir digits-run --epochs 30 --resume
    python examples/train_digits.py --checkpoint-dir digits-run --checkpoint-every 50 --resume
    python examples/train_digits.py --steps-per-call 16  # strategy.run_steps, 16 steps a call
    python examples/train_digits.py --epochs 1 --trace run.json  # a timeline for Perfetto
    python examples/train_digits.py --max-steps 20 --save-params params.npz
    # 2 workers of 2 replicas each (4 in all), every socket on loopback (docs/multi-worker.md):
    UCX_NET_DEVICES=lo .venv/bin/mpiexec -iface lo -n 2 \\
        .venv/bin/python -m mpi4py examples/train_digits.py --multi-worker --replicas 2
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import shlex
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

import aioreplica
from aioreplica.optimizers import SGD

if TYPE_CHECKING:
    from numpy.typing import NDArray

    Params = dict[str, Any]

HIDDEN = 64
CLASSES = 10


@dataclass
class Result:
    """What a training run produced."""

    params: dict[str, NDArray[np.float64]]
    losses: list[float] = field(default_factory=list)
    test_accuracy: float = math.nan
    steps: int = 0
    first_epoch: int = 0
    #: Whether this process is the chief (worker 0; always, without ``multi_worker``).
    is_chief: bool = True


# -- data and model (plain array code: NumPy on the host, CuPy on a GPU) --------------------


def load_data(seed: int = 0) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any], NDArray[Any]]:
    """The digits, scaled to [0, 1], split 80/20 into train and test with a fixed shuffle."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float64)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def init_params(seed: int = 0) -> dict[str, NDArray[np.float64]]:
    """Weights drawn with variance 1/fan_in (suits tanh), zero biases."""
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.normal(0.0, 1.0 / math.sqrt(64), (64, HIDDEN)),
        "b1": np.zeros(HIDDEN),
        "w2": rng.normal(0.0, 1.0 / math.sqrt(HIDDEN), (HIDDEN, CLASSES)),
        "b2": np.zeros(CLASSES),
    }


def logits(xp: Any, params: Params, x: Any) -> Any:
    """The forward pass: class scores for each row of ``x``."""
    hidden = xp.tanh(x @ params["w1"] + params["b1"])
    return hidden @ params["w2"] + params["b2"]


def loss_and_grads(
    xp: Any, params: Params, x: Any, y: Any, global_batch: int
) -> tuple[Any, dict[str, Any]]:
    """Cross-entropy summed over these rows and divided by the global batch size, with its
    gradients: summed over replicas they are the batch mean's."""
    rows = x.shape[0]
    hidden = xp.tanh(x @ params["w1"] + params["b1"])
    scores = hidden @ params["w2"] + params["b2"]
    scores = scores - scores.max(axis=1, keepdims=True)
    probs = xp.exp(scores)
    probs /= probs.sum(axis=1, keepdims=True)
    picked = xp.arange(rows)
    loss = -xp.log(probs[picked, y]).sum() / global_batch
    d_scores = probs
    d_scores[picked, y] -= 1.0
    d_scores /= global_batch
    d_hidden = (d_scores @ params["w2"].T) * (1.0 - hidden * hidden)
    grads = {
        "w1": x.T @ d_hidden,
        "b1": d_hidden.sum(axis=0),
        "w2": hidden.T @ d_scores,
        "b2": d_scores.sum(axis=0),
    }
    return loss, grads


def accuracy(params: Params, x: NDArray[Any], y: NDArray[Any]) -> float:
    """The fraction of rows whose highest score is the label."""
    return float(np.mean(np.argmax(logits(np, params, x), axis=1) == y))


# -- the distributed part --------------------------------------------------------------------


async def train_step(
    batch: tuple[Any, Any],
    params: dict[str, aioreplica.Variable],
    optimizer: SGD,
    global_batch: int,
) -> Any:
    """One replica's step: gradients of its rows (in its device's thread), then one update."""
    ctx = aioreplica.get_replica_context()
    assert ctx is not None
    device = ctx.device
    x, y = batch
    values = {name: variable.value() for name, variable in params.items()}
    loss, grads = await device.run(loss_and_grads, device.xp, values, x, y, global_batch)
    await optimizer.apply_gradients([(grads[name], params[name]) for name in params])
    return loss


async def recorded_step(
    batch: tuple[Any, Any],
    params: dict[str, aioreplica.Variable],
    optimizer: SGD,
    global_batch: int,
    losses: list[float],
    recorder: int = 0,
) -> None:
    """``train_step``, and the batch's loss (summed over replicas) appended to ``losses`` by
    the replica whose id is ``recorder`` (this process's first replica): how each step of
    ``run_steps`` reports, since it returns only the last step's results."""
    loss = await train_step(batch, params, optimizer, global_batch)
    ctx = aioreplica.get_replica_context()
    assert ctx is not None
    total = await ctx.all_reduce("sum", loss)
    if ctx.replica_id_in_sync_group == recorder:
        losses.append(float(total))


async def main(
    replicas: int = 4,
    epochs: int = 20,
    global_batch: int = 64,
    learning_rate: float = 0.1,
    momentum: float = 0.9,
    *,
    devices: list[str] | None = None,
    max_steps: int | None = None,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    plot: str | None = None,
    progress: bool = True,
    seed: int = 0,
    steps_per_call: int = 1,
    checkpoint_every: int | None = None,
    trace: str | None = None,
    multi_worker: bool = False,
    save_params: str | None = None,
) -> Result:
    """Train, checkpointing every epoch; return the parameters, losses and test accuracy.

    ``max_steps`` stops early (for tests), with a checkpoint there; ``checkpoint_dir=None``
    writes no checkpoints. ``steps_per_call`` > 1 runs that many steps per
    ``strategy.run_steps`` call (the replicas start once per call) instead of one ``run()``
    per step; the steps are the same. ``checkpoint_every`` also checkpoints every that many
    steps, so that a run killed in the middle of an epoch resumes there. ``trace`` writes a
    timeline of the training to that JSON file (open it in ui.perfetto.dev).

    ``multi_worker`` trains with a ``MultiWorkerMirroredStrategy``: this process is one worker
    (run every worker under ``mpiexec``), ``replicas`` and ``devices`` are its local replicas,
    ``global_batch`` the batch of all workers together. Only the chief (worker 0) prints, and
    writes checkpoints and ``save_params``; every worker returns the same parameters.
    ``checkpoint_dir`` must then name the same folder on every worker, on a filesystem they
    all see. ``save_params`` writes the final parameters to that ``.npz`` file.
    """
    if steps_per_call < 1:
        raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    local = devices or [f"cpu:{i}" for i in range(replicas)]
    strategy: aioreplica.MirroredStrategy
    if multi_worker:
        # Collective: every worker builds it, with as many local replicas as the others.
        workers = aioreplica.MultiWorkerMirroredStrategy(local)
        chief = workers.cluster.is_chief
        recorder = workers.cluster.worker_index * len(local)  # this worker's first replica
        strategy = workers
    else:
        strategy = aioreplica.MirroredStrategy(local)
        chief, recorder = True, 0
    progress = progress and chief  # one worker reports for all
    x_train, y_train, x_test, y_test = load_data(seed)
    with strategy.scope():
        params = {
            name: aioreplica.Variable(value, name=name) for name, value in init_params(seed).items()
        }
    optimizer = SGD(learning_rate, momentum=momentum)
    # One dataset for the whole run, each pass over it an epoch with a fresh permutation. The
    # checkpoint holds the current epoch's iterator: its position and the random state.
    batches = aioreplica.batched((x_train, y_train), global_batch, shuffle=True, seed=seed)
    dataset = strategy.distribute_dataset(batches, drop_remainder=True)
    checkpoint = aioreplica.Checkpoint(
        model=params, optimizer=optimizer, epoch=0, step=0, data=aiter(dataset)
    )
    manager = None
    if checkpoint_dir is not None:
        manager = aioreplica.CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=3)
        if resume and manager.latest is not None:
            await checkpoint.restore(manager.latest)
            if progress:
                print(
                    f"resumed from {manager.latest} "
                    f"(epoch {checkpoint.epoch}, step {checkpoint.step})"
                )
        elif resume and progress:
            print(f"no checkpoint in {checkpoint_dir} yet: training from the start")
    result = Result(params={}, first_epoch=checkpoint.epoch, is_chief=chief)
    steps_per_epoch = len(y_train) // global_batch
    complete = checkpoint.epoch >= epochs
    if complete and progress:
        print(
            f"training is already complete (step {checkpoint.step} of "
            f"{epochs * steps_per_epoch}): nothing to do; ask for more with --epochs"
        )
    bar = _progress(epochs * steps_per_epoch, checkpoint.step, progress and not complete)
    stopped = False

    async def count(steps: int) -> bool:
        """Record ``steps`` more steps, checkpoint if it is time; whether to stop."""
        result.steps += steps
        checkpoint.step += steps
        if bar is not None:
            bar.update(steps)
            running = np.mean(result.losses[-steps_per_epoch:])
            bar.set_postfix(epoch=checkpoint.epoch + 1, loss=f"{running:.4f}")
        stop = max_steps is not None and result.steps >= max_steps
        due = checkpoint_every is not None and checkpoint.step % checkpoint_every == 0
        if manager is not None and due and not stop:
            # Mid-epoch too: the data iterator keeps its place. A save is collective: every
            # worker calls it, the chief writes.
            await manager.save()
        return stop

    def next_call() -> int:
        """How many steps the next ``run_steps`` call takes: up to a checkpoint or the end."""
        wanted = steps_per_call
        if max_steps is not None:
            wanted = min(wanted, max_steps - result.steps)
        if checkpoint_every:
            wanted = min(wanted, checkpoint_every - checkpoint.step % checkpoint_every)
        return wanted

    # With ``trace``, a timeline of the training for Perfetto: complete when the block ends.
    tracing = strategy.trace(trace) if trace is not None else contextlib.nullcontext()
    async with tracing:
        while checkpoint.epoch < epochs and not stopped:
            if steps_per_call == 1:
                async for batch in checkpoint.data:
                    losses = await strategy.run(
                        train_step, (batch, params, optimizer, global_batch)
                    )
                    result.losses.append(float(await strategy.reduce("sum", losses)))
                    stopped = await count(1)
                    if stopped:
                        break  # the checkpoint below keeps the place in this epoch
            else:
                step = functools.partial(
                    recorded_step,
                    params=params,
                    optimizer=optimizer,
                    global_batch=global_batch,
                    losses=result.losses,
                    recorder=recorder,
                )
                while not stopped:
                    wanted = next_call()
                    before = len(result.losses)
                    await strategy.run_steps(step, checkpoint.data, wanted)
                    done = len(result.losses) - before
                    stopped = await count(done)
                    if done < wanted:
                        break  # the epoch ended
            if not stopped:  # the epoch is done: the next one is a new pass
                checkpoint.epoch += 1
                checkpoint.data = aiter(dataset)
            if manager is not None:
                await manager.save()
        await checkpoint.data.aclose()
    if bar is not None:
        bar.close()
    result.params = {name: variable.numpy() for name, variable in params.items()}
    result.test_accuracy = accuracy(result.params, x_test, y_test)
    if save_params is not None and chief:
        arrays: dict[str, Any] = dict(result.params)
        np.savez(save_params, **arrays)
    if progress:
        print(
            f"{strategy.num_replicas_in_sync} replicas, {result.steps} steps, "
            f"test accuracy {result.test_accuracy:.1%}"
        )
    if plot is not None:
        _plot(result.losses, plot, steps_per_epoch)
        if progress:
            print(f"loss curve written to {plot}")
    if trace is not None and progress:
        others = ""
        if multi_worker:
            stem, suffix = os.path.splitext(trace)
            others = f"; worker 1's to {stem}.worker1{suffix}, and so on"
        print(f"trace written to {trace}{others} (open it in ui.perfetto.dev)")
    if save_params is not None and progress:
        print(f"parameters written to {save_params}")
    return result


def _progress(total: int, done: int, enabled: bool) -> Any:
    """A progress bar over every step of the run (tqdm), or None."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc="training", unit="step")


def _plot(losses: list[float], path: str, steps_per_epoch: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    steps = np.arange(1, len(losses) + 1)
    axes.plot(steps, losses, linewidth=0.8, alpha=0.5, label="batch loss")
    if len(losses) >= steps_per_epoch:
        kernel = np.ones(steps_per_epoch) / steps_per_epoch
        smooth = np.convolve(losses, kernel, mode="valid")
        axes.plot(steps[steps_per_epoch - 1 :], smooth, label="mean over one epoch")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy")
    axes.set_yscale("log")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def new_checkpoint_dir() -> str:
    """A new, empty folder for one run's checkpoints under the system's temporary folder,
    named by the time the run started (and made unique), so runs never mix checkpoints."""
    started = time.strftime("%Y%m%d-%H%M%S")
    return tempfile.mkdtemp(prefix=f"aioreplica-train-digits-{started}-")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--replicas",
        type=int,
        default=4,
        help="host replicas (default 4); with --multi-worker, on each worker",
    )
    parser.add_argument("--gpus", action="store_true", help="one replica per visible GPU")
    parser.add_argument(
        "--multi-worker",
        action="store_true",
        help="this process is one worker of several: run every worker under mpiexec "
        "(needs the mpi extra); the chief (worker 0) reports and writes files",
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument(
        "--max-steps", type=int, metavar="N", help="stop after N steps (with a checkpoint there)"
    )
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch size")
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--plot", metavar="PNG", help="write the loss curve to this file")
    parser.add_argument(
        "--trace", metavar="JSON", help="write a timeline of the training (for ui.perfetto.dev)"
    )
    parser.add_argument(
        "--save-params", metavar="NPZ", help="write the final parameters to this .npz file"
    )
    parser.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="where checkpoints go (default: a new folder per run, printed on start)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint in DIR"
    )
    parser.add_argument("--loop", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="STEPS",
        help="also checkpoint every STEPS steps (a run killed mid-epoch then resumes there)",
    )
    parser.add_argument(
        "--steps-per-call",
        type=int,
        default=1,
        metavar="K",
        help="run K steps per strategy.run_steps call instead of one run() per step",
    )
    options = parser.parse_args()
    if options.steps_per_call < 1:
        parser.error("--steps-per-call must be >= 1")
    if options.checkpoint_every is not None and options.checkpoint_every < 1:
        parser.error("--checkpoint-every must be >= 1")
    if options.max_steps is not None and options.max_steps < 1:
        parser.error("--max-steps must be >= 1")
    if options.checkpoint_dir is None and options.resume:
        parser.error(
            "--resume needs --checkpoint-dir DIR: the folder the run to continue printed on start"
        )
    devices = None
    if options.gpus:
        devices = [name for name in aioreplica.list_devices() if name.startswith("gpu:")]
        if not devices:
            parser.error("--gpus: no GPU is visible (CuPy missing or no CUDA device)")
    chief = True
    comm: Any = None
    if options.multi_worker:
        try:
            from mpi4py import MPI
        except ImportError as exc:
            parser.error(f"--multi-worker needs mpi4py (pip install 'aioreplica[mpi]'): {exc}")
        comm = MPI.COMM_WORLD
        chief = comm.Get_rank() == 0
    if options.checkpoint_dir is None:  # a new folder for this run, never one of another run's
        # Made by the chief alone; with several workers they all use its folder (which only
        # the chief writes to; resuming needs a folder every worker sees: --checkpoint-dir).
        options.checkpoint_dir = new_checkpoint_dir() if chief else None
        if comm is not None:
            options.checkpoint_dir = comm.bcast(options.checkpoint_dir, root=0)
        again = shlex.quote(options.checkpoint_dir)
        if chief:
            print(
                f"checkpoints go to {options.checkpoint_dir} "
                f"(continue with --checkpoint-dir {again} --resume)"
            )
    elif chief:
        print(f"checkpoints go to {options.checkpoint_dir}")

    async def run() -> None:
        await main(
            options.replicas,
            options.epochs,
            options.batch_size,
            options.learning_rate,
            options.momentum,
            devices=devices,
            max_steps=options.max_steps,
            checkpoint_dir=options.checkpoint_dir,
            resume=options.resume,
            plot=options.plot,
            steps_per_call=options.steps_per_call,
            checkpoint_every=options.checkpoint_every,
            trace=options.trace,
            multi_worker=options.multi_worker,
            save_params=options.save_params,
        )

    anyio.run(run, backend=options.loop)


if __name__ == "__main__":
    cli()
