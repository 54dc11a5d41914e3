"""Optimizers at their edges: the last step count a checkpoint keeps, variables no update
fits, replicas passing different numbers of pairs, the base class, ``variables`` read both
ways, and the arguments Keras reads differently from a plain check."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import aioreplica
from aioreplica import Checkpoint, MirroredStrategy, Variable
from aioreplica.optimizers import SGD, Adagrad, Adam, AdamW, Optimizer, RMSprop
from aioreplica.testing import host_devices

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

pytestmark = pytest.mark.anyio


def state(opt: Optimizer, variables: Sequence[Variable]) -> tuple[Any, ...]:
    """Every copy of every variable and slot (as lists), the slots' names and the step."""
    slots = opt.variables()
    return (
        [[np.array(copy).tolist() for copy in v.values] for v in [*variables, *slots]],
        [slot.name for slot in slots],
        opt.iterations,
    )


def replica_id() -> int:
    ctx = aioreplica.get_replica_context()
    assert ctx is not None
    return ctx.replica_id_in_sync_group


class TestStepCount:
    async def test_the_step_past_the_last_count_is_refused(self, tmp_path: Path) -> None:
        """The step that would take ``iterations`` past ``2**63 - 1`` is refused before it
        changes anything, and the checkpoint written then restores."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(2), name="w")
        opt = Adam(0.1)
        opt.iterations = 2**63 - 2

        async def step() -> int:
            return await opt.apply_gradients([(np.ones(2), w)])

        assert (await strategy.run(step)) == 2**63 - 1
        before = state(opt, [w])
        with pytest.raises(ValueError, match=r"^apply_gradients\(\) of Adam was refused") as info:
            await strategy.run(step)
        assert str(info.value) == (
            "apply_gradients() of Adam was refused: iterations is 9223372036854775807 "
            "(2**63 - 1), the most a checkpoint keeps, so another step would take it out of "
            "range; nothing was changed: set optimizer.iterations to a smaller count to go on"
        )
        assert state(opt, [w]) == before
        path = tmp_path / "last.npz"
        await Checkpoint(opt=opt, w=w).save(path)
        with strategy.scope():
            other_w = Variable(np.zeros(2), name="w")
        other = Adam(0.1)
        await Checkpoint(opt=other, w=other_w).restore(path)
        assert state(other, [other_w]) == before


class TestVariableDtypes:
    @pytest.mark.parametrize(
        ("initial", "shown"),
        [
            (np.array([10, 20], np.int32), "int32"),
            (np.array([10, 20], np.uint8), "uint8"),
            (np.array([True, False]), "bool"),
        ],
    )
    async def test_a_variable_of_another_dtype_is_refused(self, initial: Any, shown: str) -> None:
        """A variable that is not floating-point is refused, naming it and its dtype, and the
        step changes nothing (its float neighbours neither)."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(2), name="w")
            counts = Variable(initial, name="counts")
        opt = Adam(0.5)

        async def step() -> int:
            return await opt.apply_gradients([(np.ones(2), w), (np.ones(2, initial.dtype), counts)])

        before = state(opt, [w, counts])
        with pytest.raises(TypeError) as info:
            await strategy.run(step)
        assert str(info.value) == (
            f"apply_gradients(): variable 'counts' has dtype {shown}, but optimizers update "
            "floating-point (or complex) variables only: an update of another dtype would be "
            "truncated; make it a float variable, or leave it out of grads_and_vars"
        )
        assert state(opt, [w, counts]) == before

    async def test_a_complex_variable_is_trained(self) -> None:
        """Complex variables take their update, as tf.keras' optimizers take them."""
        w = Variable(np.array([1 + 1j, 2.0]), name="w")
        await SGD(0.5).apply_gradients([(np.array([2j, 1.0]), w)])
        assert w.numpy().tolist() == [1 + 0j, 1.5 + 0j]


class TestVariables:
    async def test_a_list_that_can_also_be_called(self) -> None:
        """``optimizer.variables`` is a list of the slots, as Keras' property, and calling it
        (tf.keras' older method) returns the same list."""
        w = Variable(np.ones(2), name="w")
        b = Variable(np.ones(1), name="b")
        opt = Adam(0.1)
        assert (opt.variables, opt.variables()) == ([], [])
        await opt.apply_gradients([(np.ones(2), w), (np.ones(1), b)])
        listed = opt.variables
        assert (
            isinstance(listed, list),
            [v.name for v in listed],
            len(listed),
            listed[-1] is opt.get_slot(b, "v"),
            listed() is listed,
            [v.name for v in opt.variables()],
        ) == (True, ["w/m", "w/v", "b/m", "b/v"], 4, True, True, ["w/m", "w/v", "b/m", "b/v"])


class TestPairsCount:
    @pytest.mark.parametrize(
        ("counts", "message"),
        [
            ((2, 1, 2), "replica 0 passed 2 (gradient, variable) pairs, but replica 1 passed 1"),
            (
                (1, 2, 3),
                "replica 0 passed 1 (gradient, variable) pair, but replica 1 passed 2 and "
                "replica 2 passed 3",
            ),
            ((1, 0, 1), "replica 0 passed 1 (gradient, variable) pair, but replica 1 passed 0"),
            ((0, 2, 0), "replica 0 passed 0 (gradient, variable) pairs, but replica 1 passed 2"),
        ],
    )
    async def test_replicas_passing_different_numbers_of_pairs(
        self, counts: tuple[int, ...], message: str
    ) -> None:
        """Replicas that pass different numbers of pairs are told so in apply_gradients'
        words, naming the replicas and the numbers; nothing changes."""
        strategy = MirroredStrategy(host_devices(3))
        with strategy.scope():
            variables = [Variable(np.ones(3), name=name) for name in "abc"]
        opt = SGD(0.1, momentum=0.9)

        async def step() -> int:
            mine = variables[: counts[replica_id()]]
            return await opt.apply_gradients([(np.ones(3), v) for v in mine])

        before = state(opt, variables)
        with pytest.raises(ValueError, match=r"^apply_gradients\(\): replica 0 passed") as info:
            await strategy.run(step)
        assert str(info.value) == (
            f"apply_gradients(): {message}; every replica must pass the same variables, in the "
            "same order: pass zeros as the gradient of a variable that a replica's loss does "
            "not depend on"
        )
        assert state(opt, variables) == before


class TestBaseClass:
    async def test_the_base_class_says_what_to_implement(self) -> None:
        """A step of the base class says what a subclass implements; nothing changes."""
        w = Variable(np.ones(2), name="w")
        opt = Optimizer(0.1)
        with pytest.raises(NotImplementedError) as info:
            await opt.apply_gradients([(np.ones(2), w)])
        assert str(info.value) == (
            "Optimizer cannot apply gradients: an Optimizer subclass must implement "
            "_update_step(self, xp, var, grad, slots, rate, step), returning the new variable "
            "and its slots (in slot_names order) computed from one copy's arrays, or use SGD, "
            "Adam, AdamW, Adagrad or RMSprop; nothing was changed"
        )
        assert state(opt, [w]) == ([[[1.0, 1.0]]], [], 0)

    @pytest.mark.parametrize("below", ["Optimizer", "SGD"])
    async def test_a_keras_update_step_is_named(self, below: str) -> None:
        """A subclass written for Keras (``update_step``, which assigns) is told that it is
        not called and what to implement instead, in every replica's step, also below a
        built-in optimizer whose own rule would otherwise train silently; nothing changes."""
        events: list[str] = []

        class KerasStyle(Optimizer):
            def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
                events.append("update_step")

        class KerasSGD(SGD):  # type: ignore[misc]  # final to type checkers, not at run time
            update_step = KerasStyle.update_step

        kind = KerasStyle if below == "Optimizer" else KerasSGD
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(2), name="w")
        opt = kind(0.1)

        async def step() -> int:
            return await opt.apply_gradients([(np.ones(2), w)])

        with pytest.raises(
            NotImplementedError,
            match=re.escape(
                f"{kind.__name__} defines Keras' update_step(gradient, variable, learning_rate), "
                "which aioreplica does not call: a step computes every copy of every variable "
                "and slot first and commits them all at once, so nothing may assign during it; "
                "implement _update_step(self, xp, var, grad, slots, rate, step), returning"
            ),
        ):
            await strategy.run(step)
        assert (events, state(opt, [w])) == ([], ([[[1.0, 1.0], [1.0, 1.0]]], [], 0))

    async def test_every_replica_passing_no_pairs_changes_nothing(self) -> None:
        """An empty list on every replica is a step of nothing, as in TF: iterations stay."""
        strategy = MirroredStrategy(host_devices(2))
        opt = SGD(0.1)

        async def step() -> int:
            return await opt.apply_gradients([])

        assert strategy.experimental_local_results(await strategy.run(step)) == (0, 0)
        assert opt.iterations == 0

    async def test_a_subclass_with_an_update_step_trains(self) -> None:
        """A subclass that names its slots and implements ``_update_step`` trains, every
        copy alike, its slots kept and checkpointed as the built-in ones."""

        class SignMomentum(Optimizer):
            slot_names = ("velocity",)

            def _update_step(
                self, xp: Any, var: Any, grad: Any, slots: Sequence[Any], rate: float, step: int
            ) -> tuple[Any, ...]:
                velocity = 0.5 * slots[0] + xp.sign(grad)
                return (var - rate * velocity, velocity)

        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.zeros(2), name="w")
        opt = SignMomentum(0.1)

        async def step() -> int:
            return await opt.apply_gradients([(np.array([3.0, -1.0]), w)])

        for _ in range(2):
            await strategy.run(step)
        assert state(opt, [w]) == (
            [[[-0.25, 0.25], [-0.25, 0.25]], [[1.5, -1.5], [1.5, -1.5]]],
            ["w/velocity"],
            2,
        )


class TestKerasArguments:
    def test_adamw_without_a_weight_decay_is_a_value_error(self) -> None:
        """``AdamW(weight_decay=None)`` is a ``ValueError``, as Keras' ``AdamW`` raises."""
        with pytest.raises(ValueError, match=r"^weight_decay must be a number, got None; pass"):
            AdamW(learning_rate=1.0, weight_decay=None)  # type: ignore[arg-type]

    @pytest.mark.parametrize("clip", ["clipnorm", "clipvalue", "global_clipnorm"])
    @pytest.mark.parametrize("make", [SGD, Adagrad, RMSprop])
    async def test_a_clipping_bound_of_zero_clips_nothing(
        self, clip: str, make: type[SGD | Adagrad | RMSprop]
    ) -> None:
        """A clipping bound of ``0`` is no clipping, as Keras reads it (``if clipnorm and
        clipnorm > 0``): the steps are those of an optimizer without one, and
        ``get_config`` keeps the ``0``."""
        grads = [np.array([30.0, -40.0]), np.array([0.5, 2.0])]
        off: dict[str, Any] = {clip: 0}
        trained = []
        for opt in (make(0.1), make(0.1, **off)):
            w = Variable(np.ones(2), name="w")
            for grad in grads:
                await opt.apply_gradients([(grad, w)])
            trained.append(state(opt, [w]))
        assert trained[1] == trained[0]
        assert make(0.1, **off).get_config()[clip] == 0

    async def test_a_bound_held_in_a_variable_set_to_zero_stops_clipping(self) -> None:
        """A clipping bound held in a variable turns clipping off from the step after it is
        set to ``0``."""
        bound = Variable(1.0, name="bound")
        w = Variable(np.zeros(2), name="w")
        opt = SGD(1.0, clipnorm=bound)
        steps = []
        for value in (1.0, 0.0):
            await bound.assign(value)
            await opt.apply_gradients([(np.array([3.0, 4.0]), w)])
            steps.append(w.numpy().round(9).tolist())
        assert steps == [[-0.6, -0.8], [-3.6, -4.8]]

    async def test_a_negative_clipping_bound_is_still_refused(self) -> None:
        """Only ``0`` means no clipping: a negative bound is refused."""
        with pytest.raises(
            ValueError, match=re.escape("clipnorm must be >= 0 (0 or None: no clipping), got -1")
        ):
            SGD(0.1, clipnorm=-1)
