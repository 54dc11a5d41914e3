"""Quickstart: data-parallel linear regression on several logical CPU replicas.

Each step, every replica computes the gradient of the mean squared error on its own shard of
the data; at ``merge_call`` the gradients of all replicas meet, are averaged once, and the new
weights go back to every replica. This is the shape of data-parallel training: one step
function, N replicas, one synchronisation point per step.

Run it::

    python examples/quickstart.py                 # 4 replicas on asyncio
    python examples/quickstart.py --replicas 8 --loop trio
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import numpy as np

import aioreplica

if TYPE_CHECKING:
    from numpy.typing import NDArray

TRUE_WEIGHTS = np.array([2.0, -1.0, 0.5])


@dataclass(frozen=True)
class Result:
    weights: NDArray[np.float64]
    loss: float
    merges: int


def make_data(rows: int, seed: int = 0) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Noisy samples of ``y = x @ TRUE_WEIGHTS``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, TRUE_WEIGHTS.size))
    y = x @ TRUE_WEIGHTS + 0.01 * rng.normal(size=rows)
    return x, y


def apply_gradients(
    strategy: aioreplica.MirroredStrategy,
    gradients: aioreplica.PerReplica[NDArray[np.float64]] | NDArray[np.float64],
    weights: NDArray[np.float64],
    learning_rate: float,
) -> NDArray[np.float64]:
    """The merge function: runs once per step, in cross-replica context."""
    # With one replica, ``gradients`` is the plain array; local results cover both cases.
    local = strategy.experimental_local_results(gradients)
    mean_gradient = sum(local) / len(local)
    new_weights: NDArray[np.float64] = weights - learning_rate * mean_gradient
    return new_weights


async def train_step(
    x: NDArray[np.float64], y: NDArray[np.float64], weights: NDArray[np.float64]
) -> NDArray[np.float64]:
    """The step function: runs once per replica, on that replica's shard."""
    ctx = aioreplica.get_replica_context()
    assert ctx is not None
    error = x @ weights - y
    gradient = 2.0 * x.T @ error / len(y)
    new_weights: NDArray[np.float64] = await ctx.merge_call(
        apply_gradients, args=(gradient, weights), kwargs={"learning_rate": 0.1}
    )
    return new_weights


async def main(
    replicas: int = 4, steps: int = 100, rows: int = 4096, report: bool = True
) -> Result:
    """Train for ``steps`` steps on ``replicas`` host replicas; return the final weights."""
    strategy = aioreplica.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    x, y = make_data(rows)
    # One shard per replica: PerReplica arguments are unwrapped, one component per replica.
    x_shards = aioreplica.PerReplica(np.array_split(x, replicas))
    y_shards = aioreplica.PerReplica(np.array_split(y, replicas))
    weights = np.zeros(TRUE_WEIGHTS.size)
    for step in range(steps):
        # Every replica receives the very same new weights, so run() returns them unwrapped.
        weights = await strategy.run(train_step, args=(x_shards, y_shards, weights))
        if report and (step % 20 == 0 or step == steps - 1):
            loss = float(np.mean((x @ weights - y) ** 2))
            print(f"step {step:4d}  loss {loss:.6f}  weights {np.round(weights, 4)}")
    loss = float(np.mean((x @ weights - y) ** 2))
    merges = strategy.statistics().merge_rounds_completed
    if report:
        print(f"{replicas} replicas, {merges} merge rounds; true weights {TRUE_WEIGHTS}")
    return Result(weights=weights, loss=loss, merges=merges)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--loop", choices=["asyncio", "trio"], default="asyncio")
    options = parser.parse_args()
    anyio.run(main, options.replicas, options.steps, backend=options.loop)


if __name__ == "__main__":
    cli()
