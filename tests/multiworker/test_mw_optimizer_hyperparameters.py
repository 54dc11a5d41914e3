"""Optimizers of other strategies reading a hyperparameter from a multi-worker strategy's
variable: one given for it is read as the chief's value; one that a callable returns before
the variable's first sync is refused, as it would be this worker's own initial value.

Each worker makes the variable with an initial value of its own (the chief's is the one that
counts), and what each rank saw is compared through ``allgather``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pytest

from aioreplica import MirroredStrategy, Variable
from aioreplica.optimizers import SGD
from aioreplica.testing import host_devices
from multiworker.mwtools import RANK, WORKERS, allgather

if TYPE_CHECKING:
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio


async def test_a_variable_given_for_a_learning_rate_is_the_chiefs(
    make_strategy: MakeStrategy,
) -> None:
    """An optimizer of a strategy of this worker alone, given a multi-worker variable for its
    learning rate, steps with the chief's value on every worker."""
    strategy = make_strategy(1)
    with strategy.scope():
        rate = Variable(0.25 * (RANK + 1), name="rate")
    local = MirroredStrategy(host_devices(2))
    with local.scope():
        w = Variable(np.ones(2), name="w")
        opt = SGD(rate)

    async def step() -> None:
        await opt.apply_gradients([(np.ones(2), w)])

    await local.run(step)  # the summed gradient of the two replicas is 2
    assert allgather(w.numpy().tolist()) == [[0.5, 0.5]] * WORKERS


async def test_a_callable_returning_a_variable_before_its_first_sync_is_refused(
    make_strategy: MakeStrategy,
) -> None:
    """A step outside any ``strategy.run()`` whose callable learning rate returns a
    multi-worker variable still waiting for the chief's value is refused on every worker,
    changing nothing; once the variable is read, the step takes the chief's value."""
    strategy = make_strategy(1)
    with strategy.scope():
        rate = Variable(0.25 * (RANK + 1), name="rate")
    w = Variable(np.ones(2), name="w")
    opt = SGD(lambda: rate)
    with pytest.raises(ValueError, match=r"^learning_rate\(\) \(variable 'rate'\)") as info:
        await opt.apply_gradients([(np.ones(2), w)])
    assert (str(info.value), w.numpy().tolist(), opt.iterations) == (
        f"learning_rate() (variable 'rate') belongs to {strategy!r} and still waits for its "
        "first value from the chief, which this step of another strategy cannot fetch (every "
        "worker takes it together), so it would read this worker's own initial value; "
        "nothing was changed: read it on every worker first (its numpy()), or run a step of "
        "its strategy first",
        [1.0, 1.0],
        0,
    )
    assert rate.numpy() == 0.25
    await opt.apply_gradients([(np.ones(2), w)])
    assert allgather(w.numpy().tolist()) == [[0.75, 0.75]] * WORKERS
