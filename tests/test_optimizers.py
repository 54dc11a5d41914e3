"""Optimizers: Keras update rules, summed gradients, one merge round, all-or-nothing steps."""

from __future__ import annotations

import collections
import math
import re
import types
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import anyio
import numpy as np
import pytest

import aioreplica
from aioreplica import (
    Checkpoint,
    CheckpointError,
    MirroredStrategy,
    MirroredVariable,
    PerReplica,
    ReplicaSyncError,
    Variable,
)
from aioreplica._backends._numpy import HOST_BACKEND
from aioreplica.optimizers import SGD, Adagrad, Adam, AdamW, Optimizer, RMSprop
from aioreplica.testing import FakeDevice, StrategyFactory, host_devices

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path
    from types import ModuleType

    from aioreplica._backends import Device

    Rate = float | Callable[[int], float]

pytestmark = pytest.mark.anyio

T = TypeVar("T")
Array = np.ndarray[Any, Any]


def assert_close(got: Any, want: Any) -> None:
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)


# -- the reference: Keras' formulas in plain NumPy ----------------------------------------


class Reference:
    """Keras ``SGD``/``Adam``/``AdamW``/``Adagrad``/``RMSprop`` in plain float64 NumPy, applied
    to summed gradients.

    Clipping (``clipnorm`` or ``global_clipnorm`` in ``config``) scales the summed gradients
    by ``min(1, clip / norm)`` first; ``clipped`` records, per step, whether it scaled any.
    """

    def __init__(self, kind: str, learning_rate: Rate, **config: float) -> None:
        self.kind = kind
        self.learning_rate = learning_rate
        self.config = config
        self.iterations = 0
        self.params: dict[str, Array] = {}
        self.slots: dict[str, dict[str, Array]] = {}
        self.clipped: list[bool] = []

    def add(self, name: str, value: Any) -> None:
        self.params[name] = np.array(value, dtype=np.float64)

    def tracking(self, variables: Sequence[Variable]) -> Reference:
        """This reference, starting from the current values of ``variables``."""
        for v in variables:
            self.add(v.name, v.numpy())
        return self

    def slot_names(self) -> tuple[str, ...]:
        if self.kind in ("adam", "adamw"):
            return ("m", "v")
        if self.kind == "adagrad":
            return ("accumulator",)
        if self.kind == "rmsprop":
            names = ["velocity"]
            if self.config.get("momentum", 0.0) > 0:
                names.append("momentum")
            if self.config.get("centered", False):
                names.append("average_gradient")
            return tuple(names)
        return ("momentum",) if self.config.get("momentum", 0.0) else ()

    def slot_initial(self, slot: str) -> float:
        """Keras' initial value of a slot: Adagrad's accumulator starts above zero."""
        if slot == "accumulator":
            return self.config.get("initial_accumulator_value", 0.1)
        return 0.0

    def clip(self, grads: dict[str, Array]) -> dict[str, Array]:
        clipnorm = self.config.get("clipnorm")
        global_clipnorm = self.config.get("global_clipnorm")
        scales: dict[str, float]
        if clipnorm is not None:
            scales = {
                name: min(1.0, clipnorm / float(np.linalg.norm(g))) for name, g in grads.items()
            }
        elif global_clipnorm is not None:
            norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
            scales = dict.fromkeys(grads, min(1.0, global_clipnorm / norm))
        else:
            return grads
        self.clipped.append(any(scale < 1.0 for scale in scales.values()))
        return {name: g * scales[name] for name, g in grads.items()}

    def apply(self, grads: dict[str, Array]) -> None:
        step = self.iterations
        rate = self.learning_rate(step) if callable(self.learning_rate) else self.learning_rate
        for name, grad in self.clip(grads).items():
            slots = self.slots.setdefault(
                name,
                {
                    slot: np.full_like(self.params[name], self.slot_initial(slot))
                    for slot in self.slot_names()
                },
            )
            w = self.params[name]
            if self.kind == "adamw":
                # Decoupled weight decay, before the Adam step (Keras' ``_apply_weight_decay``).
                w = w - w * self.config.get("weight_decay", 0.004) * rate
            if self.kind in ("adam", "adamw"):
                beta_1 = self.config.get("beta_1", 0.9)
                beta_2 = self.config.get("beta_2", 0.999)
                epsilon = self.config.get("epsilon", 1e-7)
                t = step + 1
                alpha = rate * math.sqrt(1.0 - beta_2**t) / (1.0 - beta_1**t)
                slots["m"] = slots["m"] + (grad - slots["m"]) * (1.0 - beta_1)
                slots["v"] = slots["v"] + (grad * grad - slots["v"]) * (1.0 - beta_2)
                w = w - (slots["m"] * alpha) / (np.sqrt(slots["v"]) + epsilon)
            elif self.kind == "adagrad":
                epsilon = self.config.get("epsilon", 1e-7)
                slots["accumulator"] = slots["accumulator"] + grad * grad
                w = w - rate * grad / np.sqrt(slots["accumulator"] + epsilon)
            elif self.kind == "rmsprop":
                rho = self.config.get("rho", 0.9)
                momentum = self.config.get("momentum", 0.0)
                epsilon = self.config.get("epsilon", 1e-7)
                slots["velocity"] = rho * slots["velocity"] + (1.0 - rho) * grad * grad
                if self.config.get("centered", False):
                    average = rho * slots["average_gradient"] + (1.0 - rho) * grad
                    slots["average_gradient"] = average
                    denominator = slots["velocity"] - average * average + epsilon
                else:
                    denominator = slots["velocity"] + epsilon
                increment = rate * grad / np.sqrt(denominator)
                if momentum > 0:
                    slots["momentum"] = momentum * slots["momentum"] + increment
                    w = w - slots["momentum"]
                else:
                    w = w - increment
            else:
                momentum = self.config.get("momentum", 0.0)
                if momentum == 0.0:
                    w = w - rate * grad
                else:
                    slots["momentum"] = momentum * slots["momentum"] - rate * grad
                    if self.config.get("nesterov", False):
                        w = w + momentum * slots["momentum"] - rate * grad
                    else:
                        w = w + slots["momentum"]
            self.params[name] = w
        self.iterations = step + 1


def assert_matches(opt: Optimizer, variables: Sequence[Variable], ref: Reference) -> None:
    """Every copy of every variable and of every slot equals the reference; same step count."""
    assert opt.iterations == ref.iterations
    for variable in variables:
        for copy in variable.values:
            assert_close(copy, ref.params[variable.name])
        slots = ref.slots.get(variable.name, {})
        for slot_name, value in slots.items():
            for copy in opt.get_slot(variable, slot_name).values:
                assert_close(copy, value)
    assert len(opt.variables()) == sum(len(ref.slots.get(v.name, {})) for v in variables)


def snapshot(opt: Optimizer, variables: Sequence[Variable]) -> tuple[Any, ...]:
    """Host copies of every copy of every variable and slot, the slot objects and the step."""
    slots = opt.variables()
    return (
        [[np.array(copy) for copy in v.values] for v in [*variables, *slots]],
        [id(slot) for slot in slots],
        opt.iterations,
    )


def assert_unchanged(before: tuple[Any, ...], after: tuple[Any, ...]) -> None:
    (arrays_before, slots_before, step_before) = before
    (arrays_after, slots_after, step_after) = after
    assert (slots_after, step_after) == (slots_before, step_before)
    assert len(arrays_after) == len(arrays_before)
    for old, new in zip(arrays_before, arrays_after, strict=True):
        assert len(new) == len(old)
        for a, b in zip(old, new, strict=True):
            np.testing.assert_array_equal(b, a)


async def train_step(
    strategy: MirroredStrategy,
    opt: Optimizer,
    variables: Sequence[Variable],
    grads: Sequence[Sequence[Any]],
) -> Any:
    """One ``strategy.run`` step: replica ``r`` applies ``grads[r][i]`` to ``variables[i]``."""

    async def step(*mine: Any) -> int:
        return await opt.apply_gradients(zip(mine, variables, strict=True))

    args = tuple(
        PerReplica([grads[r][i] for r in range(len(grads))]) for i in range(len(variables))
    )
    return await strategy.run(step, args)


def random_grads(
    rng: np.random.Generator, replicas: int, shapes: Sequence[tuple[int, ...]]
) -> list[list[Array]]:
    return [[rng.normal(size=shape) for shape in shapes] for _ in range(replicas)]


def summed(grads: Sequence[Sequence[Array]], names: Sequence[str]) -> dict[str, Array]:
    return {name: np.sum([g[i] for g in grads], axis=0) for i, name in enumerate(names)}


def make_variables(
    strategy: MirroredStrategy, rng: np.random.Generator, shapes: dict[str, tuple[int, ...]]
) -> list[Variable]:
    with strategy.scope():
        return [Variable(rng.normal(size=shape), name=name) for name, shape in shapes.items()]


SHAPES = {"kernel": (3, 2), "bias": (2,), "scale": ()}

OPTIMIZERS: list[Any] = [
    pytest.param("sgd", 0.1, {}, id="sgd"),
    pytest.param("sgd", 0.1, {"momentum": 0.9}, id="momentum"),
    pytest.param("sgd", 0.05, {"momentum": 0.8, "nesterov": True}, id="nesterov"),
    pytest.param("adam", 0.01, {}, id="adam"),
    pytest.param("adam", 0.2, {"beta_1": 0.5, "beta_2": 0.75, "epsilon": 1e-3}, id="adam-custom"),
    pytest.param("adamw", 0.01, {}, id="adamw"),
    pytest.param(
        "adamw",
        0.2,
        {"weight_decay": 0.3, "beta_1": 0.5, "beta_2": 0.75, "epsilon": 1e-3},
        id="adamw-custom",
    ),
    pytest.param("adagrad", 0.1, {}, id="adagrad"),
    pytest.param(
        "adagrad", 0.3, {"initial_accumulator_value": 0.5, "epsilon": 1e-3}, id="adagrad-custom"
    ),
    pytest.param("adagrad", 0.1, {"initial_accumulator_value": 0.0}, id="adagrad-zero-start"),
    pytest.param("rmsprop", 0.01, {}, id="rmsprop"),
    pytest.param("rmsprop", 0.02, {"rho": 0.5, "momentum": 0.9}, id="rmsprop-momentum"),
    pytest.param("rmsprop", 0.01, {"centered": True, "epsilon": 1e-3}, id="rmsprop-centered"),
    pytest.param(
        "rmsprop",
        0.05,
        {"rho": 0.8, "momentum": 0.5, "centered": True},
        id="rmsprop-centered-momentum",
    ),
]


def make_optimizer(kind: str, learning_rate: Rate, config: dict[str, Any]) -> Optimizer:
    cls: type[Optimizer] = {
        "sgd": SGD,
        "adam": Adam,
        "adamw": AdamW,
        "adagrad": Adagrad,
        "rmsprop": RMSprop,
    }[kind]
    return cls(learning_rate, **config)


# -- update rules ------------------------------------------------------------------------


class TestUpdateRules:
    @pytest.mark.parametrize(("kind", "learning_rate", "config"), OPTIMIZERS)
    async def test_matches_keras_reference_step_by_step(
        self, kind: str, learning_rate: float, config: dict[str, Any]
    ) -> None:
        """Five steps on two replicas match the NumPy reference after every step."""
        rng = np.random.default_rng(1)
        strategy = MirroredStrategy(host_devices(2))
        variables = make_variables(strategy, rng, SHAPES)
        opt = make_optimizer(kind, learning_rate, config)
        ref = Reference(kind, learning_rate, **config).tracking(variables)
        for _ in range(5):
            grads = random_grads(rng, 2, list(SHAPES.values()))
            await train_step(strategy, opt, variables, grads)
            ref.apply(summed(grads, list(SHAPES)))
            assert_matches(opt, variables, ref)

    async def test_sgd_known_values(self) -> None:
        """Plain, momentum and Nesterov SGD give the hand-computed values of two steps."""
        results = []
        for momentum, nesterov in [(0.0, False), (0.5, False), (0.5, True)]:
            w = Variable([1.0], name="w")
            opt = SGD(0.5, momentum=momentum, nesterov=nesterov)
            for _ in range(2):
                await opt.apply_gradients([(np.array([1.0]), w)])
            results.append(w.numpy().tolist())
        # m1 = -0.5, m2 = -0.75; nesterov adds 0.5 * m - 0.5 each step.
        assert results == [[0.0], [-0.25], [-0.625]]

    async def test_adam_bias_correction_uses_iterations_plus_one(self) -> None:
        """With ``iterations`` set to 5, the first step uses t = 6 in the bias correction."""
        w = Variable(np.array([1.0, -2.0]), name="w")
        opt = Adam(0.1)
        opt.iterations = 5
        ref = Reference("adam", 0.1)
        ref.add("w", [1.0, -2.0])
        ref.iterations = 5
        for grad in ([0.5, -1.0], [2.0, 3.0]):
            assert await opt.apply_gradients([(np.array(grad), w)]) == ref.iterations + 1
            ref.apply({"w": np.array(grad)})
            assert_matches(opt, [w], ref)
        assert opt.iterations == 7

    async def test_adam_first_step_moves_by_learning_rate(self) -> None:
        """Bias correction makes Adam's first step ``lr * sign(g)`` (up to epsilon)."""
        w = Variable(np.array([1.0, 1.0]), name="w")
        await Adam(0.1, epsilon=1e-12).apply_gradients([(np.array([2.0, -3.0]), w)])
        assert_close(w.numpy(), [0.9, 1.1])

    async def test_float32_variable_stays_float32(self) -> None:
        """A float64 gradient is cast to a float32 variable's dtype; slots are float32 too."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(3, dtype=np.float32), name="w")
        opt = Adam(0.1)
        await train_step(strategy, opt, [w], [[np.ones(3)], [np.ones(3)]])
        assert [copy.dtype for copy in w.values] == [np.dtype(np.float32)] * 2
        assert [slot.dtype for slot in opt.variables()] == [np.dtype(np.float32)] * 2
        np.testing.assert_allclose(w.numpy(), np.full(3, 0.9, dtype=np.float32), rtol=1e-6)


# -- AdamW -------------------------------------------------------------------------------


def halving(step: int) -> float:
    """A learning-rate schedule: 0.1, then halved every step."""
    return 0.1 * 0.5**step


class TestAdamW:
    @pytest.mark.parametrize(
        ("learning_rate", "config"),
        [
            pytest.param(0.01, {}, id="defaults"),
            pytest.param(0.05, {"weight_decay": 0.5, "epsilon": 1e-3}, id="strong-decay"),
            pytest.param(halving, {"weight_decay": 0.2, "beta_1": 0.5}, id="schedule"),
        ],
    )
    async def test_matches_keras_reference_step_by_step(
        self, learning_rate: Rate, config: dict[str, Any]
    ) -> None:
        """Six steps on four replicas match Keras' AdamW formula after every step."""
        rng = np.random.default_rng(21)
        strategy = MirroredStrategy(host_devices(4))
        variables = make_variables(strategy, rng, SHAPES)
        opt = AdamW(learning_rate, **config)
        ref = Reference("adamw", learning_rate, **config).tracking(variables)
        for _ in range(6):
            grads = random_grads(rng, 4, list(SHAPES.values()))
            await train_step(strategy, opt, variables, grads)
            ref.apply(summed(grads, list(SHAPES)))
            assert_matches(opt, variables, ref)

    async def test_decay_comes_before_the_adam_step(self) -> None:
        """The decay shrinks the weight as it was before the step: 1 - 1 * 0.5 * 0.1 - 0.1."""
        w = Variable(np.array([1.0]), name="w")
        await AdamW(0.1, weight_decay=0.5, epsilon=1e-12).apply_gradients([(np.array([2.0]), w)])
        # Decay after the step would give 0.9 - 0.9 * 0.05 = 0.855.
        assert_close(w.numpy(), [0.85])

    async def test_decay_uses_the_scheduled_rate(self) -> None:
        """Each step decays by ``weight_decay`` times that step's scheduled learning rate."""
        w = Variable(np.array([2.0, -4.0]), name="w")
        opt = AdamW(halving, weight_decay=1.0)
        values = []
        for _ in range(3):
            # A zero gradient leaves Adam's step at zero: only the decay moves the weight.
            await opt.apply_gradients([(np.zeros(2), w)])
            values.append(w.numpy())
        assert_close(values, [[1.8, -3.6], [1.71, -3.42], [1.66725, -3.3345]])

    async def test_zero_weight_decay_is_adam(self) -> None:
        """``AdamW`` with ``weight_decay=0`` takes Adam's steps exactly."""
        rng = np.random.default_rng(22)
        strategy = MirroredStrategy(host_devices(2))
        adam_vars = make_variables(strategy, np.random.default_rng(23), SHAPES)
        adamw_vars = make_variables(strategy, np.random.default_rng(23), SHAPES)
        adam, adamw = Adam(0.1), AdamW(0.1, weight_decay=0.0)
        for _ in range(3):
            grads = random_grads(rng, 2, list(SHAPES.values()))
            await train_step(strategy, adam, adam_vars, grads)
            await train_step(strategy, adamw, adamw_vars, grads)
        pairs = zip([*adam_vars, *adam.variables()], [*adamw_vars, *adamw.variables()], strict=True)
        for a, b in pairs:
            for copy_a, copy_b in zip(a.values, b.values, strict=True):
                np.testing.assert_array_equal(copy_b, copy_a)

    async def test_checkpoint_round_trip(self, tmp_path: Path) -> None:
        """Saved after three steps and restored elsewhere, AdamW carries on as if never stopped.

        The restore goes into a fresh optimizer on four replicas; the step count (bias
        correction, schedule) and the slots come back, so its next steps match the reference.
        """
        rng = np.random.default_rng(24)
        config: dict[str, Any] = {"weight_decay": 0.3, "global_clipnorm": 1.5}
        strategy = MirroredStrategy(host_devices(2))
        variables = make_variables(strategy, rng, SHAPES)
        opt = AdamW(halving, **config)
        ref = Reference("adamw", halving, **config).tracking(variables)
        for _ in range(3):
            grads = random_grads(rng, 2, list(SHAPES.values()))
            await train_step(strategy, opt, variables, grads)
            ref.apply(summed(grads, list(SHAPES)))
        model = {v.name: v for v in variables}
        path = await Checkpoint(model=model, optimizer=opt).save(tmp_path / "adamw.npz")

        strategy_4 = MirroredStrategy(host_devices(4))
        with strategy_4.scope():
            restored_vars = [Variable(np.zeros(shape), name=name) for name, shape in SHAPES.items()]
        restored = AdamW(**opt.get_config())
        model_4 = {v.name: v for v in restored_vars}
        await Checkpoint(model=model_4, optimizer=restored).restore(path)
        assert_matches(restored, restored_vars, ref)
        assert restored.get_config() == opt.get_config()
        for _ in range(2):
            grads = random_grads(rng, 4, list(SHAPES.values()))
            await train_step(strategy_4, restored, restored_vars, grads)
            ref.apply(summed(grads, list(SHAPES)))
            assert_matches(restored, restored_vars, ref)

    async def test_checkpoint_does_not_restore_into_adam(self, tmp_path: Path) -> None:
        """An AdamW checkpoint restored into an ``Adam`` is refused; nothing changes."""
        w = Variable(np.ones(2), name="w")
        opt = AdamW(0.1)
        await opt.apply_gradients([(np.ones(2), w)])
        path = await Checkpoint(w=w, optimizer=opt).save(tmp_path / "adamw.npz")
        other_w = Variable(np.zeros(2), name="w")
        adam = Adam(0.1)
        with pytest.raises(CheckpointError, match="AdamW"):
            await Checkpoint(w=other_w, optimizer=adam).restore(path)
        assert (other_w.numpy().tolist(), adam.iterations, adam.variables()) == ([0.0, 0.0], 0, [])


# -- Adagrad and RMSprop -------------------------------------------------------------------


async def train_like_reference(
    opt: Optimizer, ref: Reference, replicas: int, steps: int, seed: int
) -> None:
    """``steps`` steps on ``replicas`` replicas, matching ``ref`` after every one."""
    rng = np.random.default_rng(seed)
    strategy = MirroredStrategy(host_devices(replicas))
    variables = make_variables(strategy, rng, SHAPES)
    ref.tracking(variables)
    for _ in range(steps):
        grads = random_grads(rng, replicas, list(SHAPES.values()))
        await train_step(strategy, opt, variables, grads)
        ref.apply(summed(grads, list(SHAPES)))
        assert_matches(opt, variables, ref)


class TestAdagrad:
    @pytest.mark.parametrize(
        ("learning_rate", "config"),
        [
            pytest.param(0.001, {}, id="defaults"),
            pytest.param(0.2, {"initial_accumulator_value": 2.0, "epsilon": 0.5}, id="custom"),
            pytest.param(halving, {"initial_accumulator_value": 0.0}, id="schedule"),
        ],
    )
    async def test_matches_keras_reference_step_by_step(
        self, learning_rate: Rate, config: dict[str, Any]
    ) -> None:
        """Six steps on four replicas match Keras' Adagrad formula after every step."""
        opt = Adagrad(learning_rate, **config)
        await train_like_reference(opt, Reference("adagrad", learning_rate, **config), 4, 6, 41)

    async def test_known_values(self) -> None:
        """The accumulator starts at its initial value and sums the squared gradients.

        5 + 2**2 = 9, so the first step is 0.3 * 2 / 3; 9 + 4**2 = 25, so the second is
        0.3 * 4 / 5. An accumulator starting at 0 would make the first step 0.3.
        """
        w = Variable(np.array([1.0]), name="w")
        opt = Adagrad(0.3, initial_accumulator_value=5.0, epsilon=1e-12)
        values = []
        for grad in (2.0, 4.0):
            await opt.apply_gradients([(np.array([grad]), w)])
            values.append([w.numpy(), opt.get_slot(w, "accumulator").numpy()])
        assert_close(values, [[[0.8], [9.0]], [[0.56], [25.0]]])

    @pytest.mark.parametrize("initial", [0.1, 0.0, 2.5])
    async def test_accumulator_starts_at_initial_value(self, initial: float) -> None:
        """``build`` makes the accumulator, mirrored beside its variable, at
        ``initial_accumulator_value`` in the variable's dtype; the first step adds ``g**2``."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones((2, 3), dtype=np.float32), name="w")
        opt = Adagrad(0.1, initial_accumulator_value=initial)
        opt.build([w])
        accumulator = opt.get_slot(w, "accumulator")
        assert isinstance(accumulator, MirroredVariable)
        assert (accumulator.name, accumulator.shape, accumulator.dtype) == (
            "w/accumulator",
            (2, 3),
            np.dtype(np.float32),
        )
        assert accumulator.distribute_strategy is strategy
        for copy in accumulator.values:
            np.testing.assert_array_equal(copy, np.full((2, 3), initial, np.float32), strict=True)
        await train_step(strategy, opt, [w], [[np.ones((2, 3))], [np.ones((2, 3))]])
        assert opt.get_slot(w, "accumulator") is accumulator
        for copy in accumulator.values:
            np.testing.assert_allclose(copy, np.full((2, 3), initial + 4.0), rtol=1e-6)

    def test_ordinary_variable_accumulator_starts_at_initial_value(self) -> None:
        """Outside any strategy, the accumulator is an ordinary variable at its initial value."""
        w = Variable(np.zeros(3), name="w")
        opt = Adagrad()
        opt.build([w])
        slot = opt.get_slot(w, "accumulator")
        assert type(slot) is Variable
        assert slot.numpy().tolist() == [0.1, 0.1, 0.1]


class TestRMSprop:
    @pytest.mark.parametrize(
        ("learning_rate", "config"),
        [
            pytest.param(0.001, {}, id="defaults"),
            pytest.param(0.05, {"momentum": 1.0, "rho": 0.0}, id="full-momentum-no-decay"),
            # Keras accepts both ends of [0, 1]: with rho 1 the velocity stays at zero.
            pytest.param(0.01, {"rho": 1.0, "centered": True}, id="rho-one"),
            pytest.param(
                halving, {"rho": 0.7, "momentum": 0.3, "centered": True}, id="schedule-centered"
            ),
        ],
    )
    async def test_matches_keras_reference_step_by_step(
        self, learning_rate: Rate, config: dict[str, Any]
    ) -> None:
        """Six steps on four replicas match Keras' RMSprop formula after every step."""
        opt = RMSprop(learning_rate, **config)
        await train_like_reference(opt, Reference("rmsprop", learning_rate, **config), 4, 6, 42)

    @pytest.mark.parametrize(
        ("config", "want"),
        [
            # velocity 0.25 * 2**2 = 1: a step of 0.1 * 2 / 1; then a zero gradient, no step.
            pytest.param({"rho": 0.75}, [0.8, 0.8], id="plain"),
            # velocity 0.5 * 2**2 = 2: a step of 0.1 * 2 / sqrt(2).
            pytest.param({"rho": 0.5}, [1 - 0.2 / math.sqrt(2), 1 - 0.2 / math.sqrt(2)], id="rho"),
            # The momentum (0.2, then 0.5 * 0.2) keeps moving the weight on a zero gradient.
            pytest.param({"rho": 0.75, "momentum": 0.5}, [0.8, 0.7], id="momentum"),
            # velocity 2, average 1: denominator 2 - 1 = 1, a step of 0.2.
            pytest.param({"rho": 0.5, "centered": True}, [0.8, 0.8], id="centered"),
            pytest.param(
                {"rho": 0.5, "momentum": 0.5, "centered": True}, [0.8, 0.7], id="centered-momentum"
            ),
        ],
    )
    async def test_known_values(self, config: dict[str, Any], want: list[float]) -> None:
        """Hand-computed weights after a gradient of 2, then one of 0."""
        w = Variable(np.array([1.0]), name="w")
        opt = RMSprop(0.1, epsilon=1e-12, **config)
        values = []
        for grad in (2.0, 0.0):
            await opt.apply_gradients([(np.array([grad]), w)])
            values.append(float(w.numpy()[0]))
        assert_close(values, want)

    async def test_slots_hold_keras_values(self) -> None:
        """After one step of a gradient of 2 with rho 0.5: velocity 2, momentum the step,
        average gradient 1."""
        w = Variable(np.array([1.0]), name="w")
        opt = RMSprop(0.1, rho=0.5, momentum=0.5, epsilon=1e-12, centered=True)
        await opt.apply_gradients([(np.array([2.0]), w)])
        slots = [opt.get_slot(w, name).numpy() for name in opt.slot_names]
        assert_close(slots, [[2.0], [0.2], [1.0]])

    async def test_checkpoint_with_other_slots_is_refused(self, tmp_path: Path) -> None:
        """A centered RMSprop's checkpoint is not restored into one that is not; nothing
        changes."""
        w = Variable(np.ones(2), name="w")
        opt = RMSprop(0.1, centered=True)
        await opt.apply_gradients([(np.ones(2), w)])
        path = await Checkpoint(w=w, optimizer=opt).save(tmp_path / "rmsprop.npz")
        other_w = Variable(np.zeros(2), name="w")
        plain = RMSprop(0.1)
        with pytest.raises(CheckpointError) as caught:
            await Checkpoint(w=other_w, optimizer=plain).restore(path)
        assert caught.value.problems == (
            "optimizer: the checkpoint holds a RMSprop optimizer with slots ['velocity', "
            "'average_gradient'], this is a RMSprop with slots ['velocity']",
        )
        assert (other_w.numpy().tolist(), plain.iterations, plain.variables()) == (
            [0.0, 0.0],
            0,
            [],
        )


class TestSlotCheckpoints:
    @pytest.mark.parametrize(
        ("kind", "config"),
        [
            pytest.param("adam", {"beta_1": 0.5, "clipnorm": 1.0}, id="adam"),
            pytest.param(
                "adagrad", {"initial_accumulator_value": 0.3, "clipnorm": 1.0}, id="adagrad"
            ),
            pytest.param("rmsprop", {"rho": 0.8, "global_clipnorm": 1.5}, id="rmsprop"),
            pytest.param(
                "rmsprop",
                {"momentum": 0.5, "centered": True, "global_clipnorm": 1.5},
                id="rmsprop-centered-momentum",
            ),
        ],
    )
    async def test_round_trip(self, tmp_path: Path, kind: str, config: dict[str, Any]) -> None:
        """Saved after three steps on two replicas and restored into a fresh optimizer on four,
        the slots and step count come back, and the next steps match the reference."""
        rng = np.random.default_rng(43)
        strategy = MirroredStrategy(host_devices(2))
        variables = make_variables(strategy, rng, SHAPES)
        opt = make_optimizer(kind, halving, config)
        ref = Reference(kind, halving, **config).tracking(variables)
        for _ in range(3):
            grads = random_grads(rng, 2, list(SHAPES.values()))
            await train_step(strategy, opt, variables, grads)
            ref.apply(summed(grads, list(SHAPES)))
        model = {v.name: v for v in variables}
        path = await Checkpoint(model=model, optimizer=opt).save(tmp_path / f"{kind}.npz")

        strategy_4 = MirroredStrategy(host_devices(4))
        with strategy_4.scope():
            restored_vars = [Variable(np.zeros(shape), name=name) for name, shape in SHAPES.items()]
        restored = type(opt)(**opt.get_config())
        model_4 = {v.name: v for v in restored_vars}
        await Checkpoint(model=model_4, optimizer=restored).restore(path)
        assert_matches(restored, restored_vars, ref)
        assert restored.slot_names == opt.slot_names
        for _ in range(2):
            grads = random_grads(rng, 4, list(SHAPES.values()))
            await train_step(strategy_4, restored, restored_vars, grads)
            ref.apply(summed(grads, list(SHAPES)))
            assert_matches(restored, restored_vars, ref)


# -- gradient clipping ---------------------------------------------------------------------


CLIPPED: list[Any] = [
    pytest.param("sgd", 0.1, {}, id="sgd"),
    pytest.param("sgd", 0.05, {"momentum": 0.8, "nesterov": True}, id="nesterov"),
    pytest.param("adam", 0.05, {}, id="adam"),
    pytest.param("adamw", 0.05, {"weight_decay": 0.2}, id="adamw"),
    pytest.param("adagrad", 0.1, {}, id="adagrad"),
    pytest.param("rmsprop", 0.05, {"momentum": 0.5, "centered": True}, id="rmsprop"),
]


def clipping(name: str, norm: float) -> dict[str, Any]:
    """The keyword argument that turns on clipping ``name`` at ``norm``."""
    return {name: norm}


class CountingXp(types.ModuleType):
    """NumPy, recording the name of every function called through it."""

    def __init__(self) -> None:
        super().__init__("counting_numpy")
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(np, name)
        if not callable(value) or isinstance(value, type):
            return value

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return value(*args, **kwargs)

        return counted


class CountingXpDevice(FakeDevice):
    """A host-backed device whose array module is a ``CountingXp``."""

    def __init__(self, index: int, xp: CountingXp) -> None:
        super().__init__(f"cpu:{index}", index)
        self.counting_xp = xp

    @property
    def xp(self) -> ModuleType:
        return self.counting_xp


class TestClipping:
    @pytest.mark.replicas(2, 4)
    @pytest.mark.parametrize(
        "clip",
        [
            pytest.param({"clipnorm": 1.5}, id="clipnorm"),
            pytest.param({"global_clipnorm": 2.5}, id="global_clipnorm"),
        ],
    )
    @pytest.mark.parametrize(("kind", "learning_rate", "config"), CLIPPED)
    async def test_matches_reference_on_summed_gradients(
        self,
        kind: str,
        learning_rate: float,
        config: dict[str, Any],
        clip: dict[str, Any],
        strategy_factory: StrategyFactory,
        replicas: int,
    ) -> None:
        """Six steps clip the summed gradients as the reference does; every copy agrees.

        Small and large gradients alternate, so that some steps are clipped and some not.
        """
        rng = np.random.default_rng(31)
        strategy = strategy_factory()
        variables = make_variables(strategy, rng, SHAPES)
        opt = make_optimizer(kind, learning_rate, {**config, **clip})
        ref = Reference(kind, learning_rate, **config, **clip).tracking(variables)
        for step in range(6):
            size = (0.1, 2.0)[step % 2]
            grads = [
                [size * g for g in r] for r in random_grads(rng, replicas, list(SHAPES.values()))
            ]
            await train_step(strategy, opt, variables, grads)
            ref.apply(summed(grads, list(SHAPES)))
            assert_matches(opt, variables, ref)
        assert ref.clipped == [False, True] * 3

    @pytest.mark.parametrize("clip", ["clipnorm", "global_clipnorm"])
    async def test_clips_the_sum_not_each_replica(self, clip: str) -> None:
        """Replica gradients under the norm can sum over it, and those over it sum under it."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.zeros(2), name="w")
        opt = SGD(1.0, **clipping(clip, 1.0))
        values = []
        # 0.6 + 0.6 = 1.2 is clipped to 1, though neither replica's gradient is over 1.
        await train_step(strategy, opt, [w], [[np.array([0.6, 0.0])], [np.array([0.6, 0.0])]])
        values.append([np.array(copy) for copy in w.values])
        # 3 - 2.5 = 0.5 is not clipped, though both replicas' gradients are over 1.
        await train_step(strategy, opt, [w], [[np.array([3.0, 0.0])], [np.array([-2.5, 0.0])]])
        values.append([np.array(copy) for copy in w.values])
        assert_close(values, [[[-1.0, 0.0]] * 2, [[-1.5, 0.0]] * 2])

    @pytest.mark.parametrize(
        ("clip", "want"),
        [
            # Each by its own norm: a (norm 3) and b (norm 4) to 2; c (norm 0) stays 0.
            pytest.param({"clipnorm": 2.0}, [[-2.0, 0.0], [-2.0], [0.0, 0.0]], id="clipnorm"),
            # All by their joint norm 5, scaled by 2 / 5 together.
            pytest.param(
                {"global_clipnorm": 2.0}, [[-1.2, 0.0], [-1.6], [0.0, 0.0]], id="global_clipnorm"
            ),
            pytest.param({"clipnorm": 4.0}, [[-3.0, 0.0], [-4.0], [0.0, 0.0]], id="clipnorm-above"),
            pytest.param(
                {"global_clipnorm": 5.0}, [[-3.0, 0.0], [-4.0], [0.0, 0.0]], id="global-at-norm"
            ),
        ],
    )
    async def test_known_values(self, clip: dict[str, Any], want: list[list[float]]) -> None:
        """Hand-computed clipped steps of ordinary variables, outside any strategy."""
        a, b, c = (Variable(np.zeros(n), name=name) for name, n in (("a", 2), ("b", 1), ("c", 2)))
        opt = SGD(1.0, **clip)
        grads = [np.array([3.0, 0.0]), np.array([4.0]), np.zeros(2)]
        await opt.apply_gradients(zip(grads, [a, b, c], strict=True))
        for variable, value in zip([a, b, c], want, strict=True):
            assert_close(variable.numpy(), value)

    @pytest.mark.parametrize("clip", ["clipnorm", "global_clipnorm"])
    async def test_zero_gradients_stay_zero(self, clip: str) -> None:
        """A gradient of norm 0 is left as it is, with no NaN from a division by zero."""
        w = Variable(np.ones(3), name="w")
        opt = SGD(0.5, momentum=0.9, **clipping(clip, 1.0))
        await opt.apply_gradients([(np.zeros(3), w)])
        assert w.numpy().tolist() == [1.0, 1.0, 1.0]
        assert opt.get_slot(w, "momentum").numpy().tolist() == [0.0, 0.0, 0.0]

    async def test_non_finite_global_norm_makes_the_step_nan(self) -> None:
        """As Keras: an infinite gradient under ``global_clipnorm`` turns every update NaN.

        A diverged step shows in every variable instead of silently shrinking to zero.
        """
        a, b = Variable(np.zeros(2), name="a"), Variable(np.zeros(1), name="b")
        opt = SGD(1.0, global_clipnorm=1.0)
        await opt.apply_gradients([(np.array([np.inf, 1.0]), a), (np.array([1.0]), b)])
        assert np.isnan(a.numpy()).all()
        assert np.isnan(b.numpy()).all()

    @pytest.mark.parametrize("clip", ["clipnorm", "global_clipnorm"])
    async def test_gradients_keep_their_dtype(self, clip: str) -> None:
        """A float32 gradient reaches the update as float32 beside a float64 one.

        The joint norm of float32 and float64 gradients is a float64; it scales the float32
        gradient in float32, so that clipping does not widen the update.
        """
        seen: list[tuple[str, str]] = []

        class Recording(Optimizer):
            def _update_step(
                self, xp: Any, var: Any, grad: Any, slots: Sequence[Any], rate: float, step: int
            ) -> tuple[Any, ...]:
                seen.append((var.dtype.name, grad.dtype.name))
                return (var - rate * grad,)

        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w32 = Variable(np.ones(3, dtype=np.float32), name="w32")
            w64 = Variable(np.ones(2), name="w64")
        opt = Recording(1.0, **clipping(clip, 0.3))
        g32, g64 = np.array([0.1, 0.2, 0.3], np.float32), np.array([0.4, 0.5])
        await train_step(strategy, opt, [w32, w64], [[g32, g64], [g32, g64]])
        assert seen == [("float32", "float32"), ("float64", "float64")]

    @pytest.mark.parametrize("clip", ["clipnorm", "global_clipnorm"])
    async def test_norms_use_the_devices_array_module(self, clip: str) -> None:
        """The norms are computed with the devices' ``xp`` (CuPy on GPUs), not plain NumPy.

        The calls a clipped step makes beyond those of the same step unclipped are the
        clipping's.
        """
        xp = CountingXp()
        strategy = MirroredStrategy([CountingXpDevice(i, xp) for i in range(2)])
        rng = np.random.default_rng(32)
        variables = make_variables(strategy, rng, SHAPES)
        grads = random_grads(rng, 2, list(SHAPES.values()))
        await train_step(strategy, SGD(0.1), variables, grads)
        unclipped = collections.Counter(xp.calls)
        xp.calls.clear()
        opt = SGD(0.1, **clipping(clip, 0.5))
        ref = Reference("sgd", 0.1, **clipping(clip, 0.5)).tracking(variables)
        await train_step(strategy, opt, variables, grads)
        ref.apply(summed(grads, list(SHAPES)))
        assert_matches(opt, variables, ref)
        # A norm takes a square root: the clipping's calls are the step's extra ones.
        assert "sqrt" in collections.Counter(xp.calls) - unclipped


# -- apply_gradients across replicas ------------------------------------------------------


class TestApplyGradients:
    async def test_gradients_summed_across_replicas(self) -> None:
        """Each replica's own gradients are summed; every copy and slot copy gets the update."""
        rng = np.random.default_rng(2)
        strategy = MirroredStrategy(host_devices(4))
        variables = make_variables(strategy, rng, SHAPES)
        opt = SGD(0.1, momentum=0.9)
        ref = Reference("sgd", 0.1, momentum=0.9).tracking(variables)
        for _ in range(3):
            grads = random_grads(rng, 4, list(SHAPES.values()))
            await train_step(strategy, opt, variables, grads)
            ref.apply(summed(grads, list(SHAPES)))
        assert_matches(opt, variables, ref)
        for v in [*variables, *opt.variables()]:
            assert len(v.values) == 4

    async def test_returns_iterations_after_step(self) -> None:
        """Every replica gets ``iterations`` after the step; ``opt.iterations`` counts steps."""
        strategy = MirroredStrategy(host_devices(3))
        with strategy.scope():
            w = Variable(np.zeros(2), name="w")
        opt = Adam(0.01)
        returned: list[list[int]] = []

        async def step() -> None:
            returned.append([await opt.apply_gradients([(np.ones(2), w)])])

        assert opt.iterations == 0
        results = [await train_step(strategy, opt, [w], [[np.ones(2)]] * 3) for _ in range(3)]
        for _ in range(2):
            await strategy.run(step)
        assert results == [1, 2, 3]
        assert returned == [[4], [4], [4], [5], [5], [5]]
        assert opt.iterations == 5

    async def test_one_merge_round_per_step(self) -> None:
        """A step over several variables takes exactly one merge round."""
        rng = np.random.default_rng(3)
        strategy = MirroredStrategy(host_devices(4))
        variables = make_variables(strategy, rng, SHAPES)
        opt = Adam(0.01)
        rounds = []
        for _ in range(3):
            before = strategy.statistics().merge_rounds_completed
            await train_step(strategy, opt, variables, random_grads(rng, 4, list(SHAPES.values())))
            rounds.append(strategy.statistics().merge_rounds_completed - before)
        assert rounds == [1, 1, 1]

    @pytest.mark.parametrize(
        "clip",
        [
            pytest.param({}, id="unclipped"),
            pytest.param({"clipnorm": 1.0}, id="clipnorm"),
            pytest.param({"global_clipnorm": 1.0}, id="global_clipnorm"),
        ],
    )
    async def test_one_packed_all_reduce_per_step(
        self, monkeypatch: pytest.MonkeyPatch, clip: dict[str, Any]
    ) -> None:
        """Several small float64 gradients go through one all-reduce per step, packed.

        Clipping adds none: it works on the summed gradients inside the same merge round.
        """
        rng = np.random.default_rng(4)
        shapes = {"a": (4,), "b": (2, 3), "c": (), "d": (5,)}
        strategy = MirroredStrategy(host_devices(3))
        variables = make_variables(strategy, rng, shapes)
        calls: list[tuple[str, int, int, int]] = []
        original_packed = HOST_BACKEND.all_reduce_packed
        original = HOST_BACKEND.all_reduce

        async def recording_packed(
            op: str, leaves: Sequence[Sequence[Any]], devices: Sequence[Device]
        ) -> Any:
            size = sum(int(np.asarray(leaf[0]).size) for leaf in leaves)
            calls.append((op, len(leaves), len(devices), size))
            return await original_packed(op, leaves, devices)

        async def recording(op: str, inputs: Sequence[Any], devices: Sequence[Device]) -> Any:
            calls.append((op, 1, len(inputs), int(np.asarray(inputs[0]).size)))
            return await original(op, inputs, devices)

        monkeypatch.setattr(HOST_BACKEND, "all_reduce_packed", recording_packed)
        monkeypatch.setattr(HOST_BACKEND, "all_reduce", recording)
        opt = SGD(0.1, momentum=0.5, **clip)
        ref = Reference("sgd", 0.1, momentum=0.5, **clip).tracking(variables)
        rounds = []
        for _ in range(3):
            grads = random_grads(rng, 3, list(shapes.values()))
            before = strategy.statistics().merge_rounds_completed
            await train_step(strategy, opt, variables, grads)
            rounds.append(strategy.statistics().merge_rounds_completed - before)
            ref.apply(summed(grads, list(shapes)))
        assert calls == [("sum", 4, 3, 4 + 6 + 1 + 5)] * 3
        assert rounds == [1, 1, 1]
        assert ref.clipped == ([True] * 3 if clip else [])
        assert_matches(opt, variables, ref)

    async def test_accepts_zip_and_lists(self) -> None:
        """``grads_and_vars`` may be a one-shot iterator such as ``zip``, of tuples or lists."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.zeros(2), name="w")
            b = Variable(0.0, name="b")

        async def step() -> int:
            grads = [np.ones(2), 1]
            await opt.apply_gradients(zip(grads, [w, b], strict=True))
            pairs: list[Any] = [[np.ones(2), w], [2.0, b]]
            return await opt.apply_gradients(pairs)

        opt = SGD(0.25)
        assert await strategy.run(step) == 2
        assert [w.numpy().tolist(), float(b)] == [[-1.0, -1.0], -1.5]

    async def test_none_gradients_are_skipped(self) -> None:
        """Variables whose gradient is None keep their value and get no slots; others update."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(2), name="w")
            b = Variable(np.ones(3), name="b")
        opt = SGD(0.5, momentum=0.9)

        async def step() -> int:
            return await opt.apply_gradients([(None, w), (np.ones(3), b)])

        assert await strategy.run(step) == 1
        assert [copy.tolist() for copy in w.values] == [[1.0, 1.0]] * 2
        assert [copy.tolist() for copy in b.values] == [[0.0, 0.0, 0.0]] * 2
        assert [slot.name for slot in opt.variables()] == ["b/momentum"]
        with pytest.raises(ValueError, match="SGD has no slots for variable 'w' yet"):
            opt.get_slot(w, "momentum")

    async def test_shared_gradient_object_counts_once_per_replica(self) -> None:
        """One array object passed by every replica is summed once per replica, as a value."""
        strategy = MirroredStrategy(host_devices(3))
        with strategy.scope():
            w = Variable(np.zeros(2), name="w")
        shared = np.array([1.0, -2.0])
        opt = SGD(0.1)

        async def step() -> int:
            return await opt.apply_gradients([(shared, w)])

        await strategy.run(step)
        assert_close(w.values[0], [-0.3, 0.6])
        assert_close(w.values[2], [-0.3, 0.6])

    async def test_replicas_disagreeing_on_variables(self) -> None:
        """Replicas that train different variables get a clear error; nothing changes."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(3), name="w")
            b = Variable(np.ones(3), name="b")
        opt = SGD(0.1)
        before = snapshot(opt, [w, b])

        async def step() -> int:
            ctx = aioreplica.get_replica_context()
            assert ctx is not None
            mine = w if ctx.replica_id_in_sync_group == 0 else b
            return await opt.apply_gradients([(np.ones(3), mine)])

        with pytest.raises((ValueError, ReplicaSyncError)) as info:
            await strategy.run(step)
        assert "replica" in str(info.value)
        assert_unchanged(before, snapshot(opt, [w, b]))


# -- replica equivalence ------------------------------------------------------------------


class TestWithoutAggregation:
    """apply_gradients(experimental_aggregate_gradients=False) (Keras:
    skip_gradients_aggregation=True) applies gradients aggregated already, as TF's does."""

    @pytest.mark.parametrize(
        "flag",
        [
            pytest.param({"experimental_aggregate_gradients": False}, id="tf"),
            pytest.param({"skip_gradients_aggregation": True}, id="keras"),
        ],
    )
    async def test_all_reduced_gradients_are_applied_once(self, flag: dict[str, Any]) -> None:
        """Gradients all-reduced in the step, then applied without aggregation, give the
        step that summing them in apply_gradients gives (not one N times as large)."""
        strategy = MirroredStrategy(host_devices(3))
        with strategy.scope():
            own = Variable(np.zeros(2), name="own")
            summed = Variable(np.zeros(2), name="summed")
        opt_own, opt_summed = Adam(0.1), Adam(0.1)

        async def step(grad: Any) -> None:
            ctx = aioreplica.get_replica_context()
            assert ctx is not None
            reduced = await ctx.all_reduce("sum", grad)
            await opt_own.apply_gradients([(reduced, own)], **flag)
            await opt_summed.apply_gradients([(grad, summed)])

        for k in range(3):
            await strategy.run(step, args=(PerReplica([np.array([i + 1.0, k]) for i in range(3)]),))
        np.testing.assert_array_equal(own.numpy(), summed.numpy(), strict=True)
        assert opt_own.iterations == opt_summed.iterations == 3

    async def test_gradients_that_differ_are_refused(self) -> None:
        """Different gradients would make a variable's copies differ: ValueError naming the
        variable and the odd replica; no variable, slot or step count changes."""
        strategy = MirroredStrategy(host_devices(3))
        with strategy.scope():
            w = Variable(np.ones(2), name="w")
            b = Variable(np.ones(1), name="b")
        opt = SGD(0.1, momentum=0.9)

        async def step(grad: Any) -> None:
            await opt.apply_gradients(
                [(grad, w), (np.ones(1), b)], experimental_aggregate_gradients=False
            )

        await strategy.run(step, args=(np.ones(2),))  # equal everywhere: applied once
        assert (w.numpy().tolist(), b.numpy().tolist(), opt.iterations) == ([0.9, 0.9], [0.9], 1)
        before = [v.numpy() for v in [w, b, *opt.variables()]]
        grads = PerReplica([np.ones(2), np.ones(2), np.full(2, 2.0)])
        with pytest.raises(
            ValueError,
            match=r"^apply_gradients\(\) without aggregation: the replicas passed different "
            r"gradients for 'w' \(replica 2 passed another than replica 0's \[1\.0, 1\.0\]\); ",
        ):
            await strategy.run(step, args=(grads,))
        for v, want in zip([w, b, *opt.variables()], before, strict=True):
            np.testing.assert_array_equal(v.numpy(), want, strict=True)
        assert opt.iterations == 1

    async def test_replicas_must_agree_on_the_flag(self) -> None:
        """One replica aggregating while another does not is ReplicaSyncError; nothing
        changes."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.zeros(2), name="w")
        opt = SGD(0.1)

        async def step() -> None:
            ctx = aioreplica.get_replica_context()
            assert ctx is not None
            aggregate = ctx.replica_id_in_sync_group == 0
            await opt.apply_gradients([(np.ones(2), w)], experimental_aggregate_gradients=aggregate)

        with pytest.raises(ReplicaSyncError, match=r"whether apply_gradients\(\) aggregates"):
            await strategy.run(step)
        assert (w.numpy().tolist(), opt.iterations) == ([0.0, 0.0], 0)

    @pytest.mark.parametrize(
        "keyword", ["experimental_aggregate_gradients", "skip_gradients_aggregation"]
    )
    async def test_a_flag_that_is_no_bool_is_refused(self, keyword: str) -> None:
        """\"no\" would be true: TypeError naming the flag."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.zeros(2), name="w")
        opt = SGD(0.1)

        async def step() -> None:
            flags: dict[str, Any] = {keyword: "no"}
            await opt.apply_gradients([(np.ones(2), w)], **flags)

        with pytest.raises(
            TypeError, match=f"^apply_gradients\\(\\): {keyword} must be True or False"
        ):
            await strategy.run(step)
        assert (w.numpy().tolist(), opt.iterations) == ([0.0, 0.0], 0)

    @pytest.mark.parametrize("aggregate", [True, False])
    async def test_one_replica_either_way(self, aggregate: bool) -> None:
        """With one replica there is nothing to aggregate: both give the same step (TF's
        test_custom_aggregation_one_device)."""
        strategy = MirroredStrategy(host_devices(1))
        with strategy.scope():
            w = Variable(np.zeros(2), name="w")

        async def step() -> None:
            await SGD(0.1).apply_gradients(
                [(np.ones(2), w)], "step", experimental_aggregate_gradients=aggregate
            )

        await strategy.run(step)
        np.testing.assert_array_equal(w.numpy(), [-0.1, -0.1], strict=True)


class TestReplicaEquivalence:
    @pytest.mark.parametrize(
        "make",
        [
            pytest.param(lambda: SGD(0.05, momentum=0.9), id="sgd-momentum"),
            pytest.param(lambda: SGD(0.05, momentum=0.9, nesterov=True), id="nesterov"),
            pytest.param(lambda: Adam(0.05), id="adam"),
            pytest.param(lambda: AdamW(0.05, weight_decay=0.1), id="adamw"),
            pytest.param(lambda: SGD(0.05, momentum=0.9, clipnorm=0.2), id="sgd-clipnorm"),
            pytest.param(lambda: Adam(0.05, global_clipnorm=0.2), id="adam-global-clipnorm"),
            pytest.param(lambda: Adagrad(0.05), id="adagrad"),
            pytest.param(lambda: Adagrad(0.05, clipnorm=0.2), id="adagrad-clipnorm"),
            pytest.param(lambda: RMSprop(0.01, momentum=0.5), id="rmsprop-momentum"),
            pytest.param(
                lambda: RMSprop(0.01, centered=True, global_clipnorm=0.2),
                id="rmsprop-centered-global-clipnorm",
            ),
        ],
    )
    async def test_four_replicas_train_like_one(self, make: Callable[[], Optimizer]) -> None:
        """4 replicas on a split global batch reach the parameters of 1 replica on all of it."""
        rng = np.random.default_rng(5)
        batches = [(rng.normal(size=(16, 3)), rng.normal(size=16)) for _ in range(10)]
        w0, b0 = rng.normal(size=3), 0.5
        global_batch = 16

        async def step(x: Array, y: Array, w: Variable, b: Variable, opt: Optimizer) -> None:
            residual = x @ w.value() + b.value() - y
            # Gradients of sum(residual**2) / global_batch: summed over replicas, the mean.
            grad_w = 2.0 * x.T @ residual / global_batch
            grad_b = 2.0 * residual.sum() / global_batch
            await opt.apply_gradients([(grad_w, w), (grad_b, b)])

        trained = []
        for replicas in (1, 4):
            strategy = MirroredStrategy(host_devices(replicas))
            with strategy.scope():
                w = Variable(w0, name="w")
                b = Variable(b0, name="b")
            opt = make()
            for x, y in batches:
                parts = 16 // replicas
                xs = PerReplica([x[r * parts : (r + 1) * parts] for r in range(replicas)])
                ys = PerReplica([y[r * parts : (r + 1) * parts] for r in range(replicas)])
                await strategy.run(step, (xs, ys, w, b, opt))
            assert opt.iterations == 10
            for v in (w, b, *opt.variables()):
                for copy in v.values[1:]:
                    np.testing.assert_array_equal(copy, v.values[0])
            trained.append([np.array(v.values[0]) for v in (w, b, *opt.variables())])
        one, four = trained
        assert len(one) == len(four)
        for a, b_ in zip(one, four, strict=True):
            np.testing.assert_allclose(b_, a, rtol=1e-12, atol=1e-12)
        assert not np.allclose(one[0], w0)  # it did train


# -- learning rate ------------------------------------------------------------------------


class TestLearningRate:
    def test_float(self) -> None:
        """A number is the rate of every step; ints become floats."""
        opt = SGD(1)
        assert opt.learning_rate == 1
        assert opt.current_learning_rate() == 1.0
        assert isinstance(opt.current_learning_rate(), float)
        half: Any = np.float32(0.5)
        assert Adam(half).current_learning_rate() == 0.5

    async def test_schedule_gets_iterations_before_step(self) -> None:
        """The schedule is called with the step count before each step; its rate is used."""
        calls: list[int] = []

        def rates(step: int) -> float:
            return 0.5 * 0.5**step

        def schedule(step: int) -> float:
            calls.append(step)
            return rates(step)

        rng = np.random.default_rng(6)
        strategy = MirroredStrategy(host_devices(2))
        variables = make_variables(strategy, rng, {"w": (3,)})
        opt = SGD(schedule, momentum=0.5)
        ref = Reference("sgd", rates, momentum=0.5)
        ref.add("w", variables[0].numpy())
        for _ in range(4):
            grads = random_grads(rng, 2, [(3,)])
            await train_step(strategy, opt, variables, grads)
            ref.apply(summed(grads, ["w"]))
        assert calls == [0, 1, 2, 3]
        assert opt.learning_rate is schedule
        assert_matches(opt, variables, ref)

    async def test_current_learning_rate_follows_schedule(self) -> None:
        """``current_learning_rate()`` is the schedule at the current step count."""
        calls: list[int] = []

        def schedule(step: int) -> float:
            calls.append(step)
            return 1.0 / (step + 1)

        w = Variable(np.zeros(1), name="w")
        opt = Adam(schedule)
        seen = [opt.current_learning_rate()]
        await opt.apply_gradients([(np.ones(1), w)])
        seen.append(opt.current_learning_rate())
        opt.iterations = 9
        seen.append(opt.current_learning_rate())
        assert seen == [1.0, 0.5, 0.1]
        assert calls == [0, 0, 1, 9]

    async def test_schedule_returning_non_number_changes_nothing(self) -> None:
        """A schedule returning a string fails the step with TypeError; nothing changes."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(2), name="w")
        opt = Adam(lambda step: 0.1 if step == 0 else "fast")  # type: ignore[arg-type]
        await train_step(strategy, opt, [w], [[np.ones(2)]] * 2)
        before = snapshot(opt, [w])
        with pytest.raises(
            TypeError, match=re.escape("learning_rate(1) must be a number, got str")
        ):
            await train_step(strategy, opt, [w], [[np.ones(2)]] * 2)
        assert_unchanged(before, snapshot(opt, [w]))

    async def test_schedule_returning_nan_changes_nothing(self) -> None:
        """A schedule returning NaN fails the first step with ValueError; no slots are made."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(2), name="w")
        opt = SGD(lambda step: math.nan, momentum=0.9)
        before = snapshot(opt, [w])
        with pytest.raises(ValueError, match=re.escape("learning_rate(0) must be finite, got nan")):
            await train_step(strategy, opt, [w], [[np.ones(2)]] * 2)
        assert_unchanged(before, snapshot(opt, [w]))
        assert opt.variables() == []

    async def test_callable_of_no_arguments_is_called_with_none(self) -> None:
        """A callable that needs no argument (Keras' plain callable, one with an optional one
        included) is called with none; one that needs one (a schedule) gets the step count."""
        calls: list[tuple[str, tuple[int, ...]]] = []

        def constant() -> float:
            calls.append(("constant", ()))
            return 0.25

        def optional(step: int = 7) -> float:
            calls.append(("optional", (step,)))
            return 0.125

        class Schedule:  # as Keras' LearningRateSchedule: __call__(self, step)
            def __call__(self, step: int) -> float:
                calls.append(("schedule", (step,)))
                return 0.5

        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.zeros(2), name="w")
        for rate in (constant, optional, Schedule(), lambda: 1.0):
            opt = SGD(rate)
            for _ in range(2):
                await train_step(strategy, opt, [w], [[np.ones(2)]] * 2)
        assert calls == [
            ("constant", ()),
            ("constant", ()),
            ("optional", (7,)),
            ("optional", (7,)),
            ("schedule", (0,)),
            ("schedule", (1,)),
        ]
        # Each step's summed gradient is 2: 2 * 2 * (0.25 + 0.125 + 0.5 + 1.0).
        assert [copy.tolist() for copy in w.values] == [[-7.5, -7.5]] * 2

    async def test_callable_of_no_arguments_returning_non_number_changes_nothing(self) -> None:
        """A callable of no arguments that returns a string fails the step with a TypeError
        that shows the call; nothing changes."""
        w = Variable(np.ones(2), name="w")
        opt = SGD(lambda: "fast", momentum=0.5)  # type: ignore[arg-type]
        before = snapshot(opt, [w])
        with pytest.raises(TypeError, match=re.escape("learning_rate() must be a number, got str")):
            await opt.apply_gradients([(np.ones(2), w)])
        assert_unchanged(before, snapshot(opt, [w]))

    @pytest.mark.parametrize(
        ("rate", "shown"),
        [
            (lambda step, scale: 0.1, "<lambda>(step, scale), which is neither"),
            (lambda *, step: 0.1, "<lambda>(*, step), which is neither"),
        ],
    )
    def test_callable_needing_other_arguments_is_refused(
        self, rate: Callable[..., float], shown: str
    ) -> None:
        """A callable that can be called neither with no argument nor with the step count is
        a TypeError at construction."""
        with pytest.raises(
            TypeError,
            match=re.escape(
                "learning_rate must be a number, a callable of no arguments or a schedule "
                f"called with the step count, learning_rate(step); got {shown}"
            ),
        ):
            SGD(rate)

    async def test_set_learning_rate(self) -> None:
        """Setting ``learning_rate`` (a number, a schedule, a callable of no arguments) sets
        the rate of the next steps, as in Keras."""
        w = Variable(np.zeros(1), name="w")
        opt = SGD(0.1)
        rates: list[float] = []

        def schedule(step: int) -> float:
            return 2.0**-step

        def constant() -> float:
            return 0.125

        for rate in (0.5, schedule, constant, 3):
            opt.learning_rate = rate
            assert opt.learning_rate == rate
            rates.append(opt.current_learning_rate())
            await opt.apply_gradients([(np.ones(1), w)])
        assert rates == [0.5, 0.5, 0.125, 3.0]  # the schedule at step 1: 2**-1
        assert w.numpy().tolist() == [-(0.5 + 0.5 + 0.125 + 3.0)]
        assert opt.get_config()["learning_rate"] == 3.0

    @pytest.mark.parametrize(
        ("bad", "error", "message"),
        [
            ("fast", TypeError, "learning_rate must be a number, got str 'fast'"),
            (math.nan, ValueError, "learning_rate must be finite, got nan"),
            (None, TypeError, "learning_rate must be a number, got NoneType None"),
            (lambda a, b: 0.1, TypeError, "learning_rate must be a number, a callable of no"),
        ],
    )
    def test_setting_a_bad_learning_rate_changes_nothing(
        self, bad: Any, error: type[Exception], message: str
    ) -> None:
        """A bad value set to ``learning_rate`` is refused as the constructor refuses it; the
        rate stays as it was."""
        for before in (0.5, lambda step: 0.1 * step):
            opt = SGD(before)
            opt.iterations = 3
            rate = opt.current_learning_rate()
            with pytest.raises(error, match=re.escape(message)):
                opt.learning_rate = bad
            assert opt.learning_rate == before
            assert opt.current_learning_rate() == rate


# -- slots -----------------------------------------------------------------------------


class TestCustomOptimizers:
    @pytest.mark.parametrize("returned", ["a wrong shape", "a slot too few"])
    async def test_an_update_step_of_the_wrong_shape_is_refused(self, returned: str) -> None:
        """A subclass's _update_step must return the variable and each slot in the
        variable's shape: anything else is a ValueError, and nothing changes (the variable
        is not silently reshaped)."""

        class Bad(Optimizer):
            slot_names = ("m",)

            def _update_step(
                self, xp: Any, var: Any, grad: Any, slots: Sequence[Any], rate: float, step: int
            ) -> tuple[Any, ...]:
                if returned == "a wrong shape":
                    return (xp.zeros(7), slots[0])
                return (var - rate * grad,)

        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.zeros(3), name="w")
        opt = Bad(0.1)

        async def step() -> int:
            return await opt.apply_gradients([(np.ones(3), w)])

        with pytest.raises(
            ValueError, match=r"^Bad\._update_step returned .* each of the variable's shape \(3,\)"
        ):
            await strategy.run(step)
        assert (w.shape, opt.iterations) == ((3,), 0)
        for copy in w.values:
            np.testing.assert_array_equal(copy, np.zeros(3), strict=True)


class TestSlots:
    def test_slot_names(self) -> None:
        """SGD with momentum keeps "momentum", without none; Adam keeps "m" and "v"."""
        assert SGD(0.1, momentum=0.9).slot_names == ("momentum",)
        assert SGD(0.1).slot_names == ()
        assert SGD(0.1, momentum=0.0, nesterov=True).slot_names == ()
        assert Adam().slot_names == ("m", "v")
        assert AdamW().slot_names == ("m", "v")

    def test_slot_names_of_adagrad_and_rmsprop(self) -> None:
        """Adagrad keeps "accumulator"; RMSprop "velocity", then "momentum" if momentum > 0,
        then "average_gradient" if centered."""
        assert Adagrad().slot_names == ("accumulator",)
        assert RMSprop().slot_names == ("velocity",)
        assert RMSprop(momentum=0.9).slot_names == ("velocity", "momentum")
        assert RMSprop(centered=True).slot_names == ("velocity", "average_gradient")
        assert RMSprop(momentum=0.1, centered=True).slot_names == (
            "velocity",
            "momentum",
            "average_gradient",
        )
        assert RMSprop(momentum=0.0, centered=False).slot_names == ("velocity",)

    async def test_created_on_first_step_beside_variable(self) -> None:
        """The first step makes mirrored slots on the variable's devices, of its strategy."""
        strategy = MirroredStrategy(host_devices(3))
        with strategy.scope():
            w = Variable(np.ones((2, 2), dtype=np.float32), name="w")
        opt = Adam(0.1)
        assert opt.variables() == []
        with pytest.raises(
            ValueError,
            match=re.escape(
                "Adam has no slots for variable 'w' yet: they are made by its first "
                "apply_gradients() or by build()"
            ),
        ):
            opt.get_slot(w, "m")
        await train_step(strategy, opt, [w], [[np.ones((2, 2))]] * 3)
        m, v = opt.get_slot(w, "m"), opt.get_slot(w, "v")
        assert opt.variables() == [m, v]
        for slot, name in ((m, "w/m"), (v, "w/v")):
            assert isinstance(slot, MirroredVariable)
            assert slot.name == name
            assert slot.devices == w.devices == ("cpu:0", "cpu:1", "cpu:2")
            assert slot.distribute_strategy is strategy
            assert (slot.shape, slot.dtype) == ((2, 2), np.dtype(np.float32))
            assert len(slot.values) == 3
            assert not slot.trainable
        np.testing.assert_allclose(m.values[2], np.full((2, 2), 0.3, np.float32), rtol=1e-6)
        np.testing.assert_allclose(v.values[1], np.full((2, 2), 0.009, np.float32), rtol=1e-6)

    async def test_build_creates_zero_slots_beforehand(self) -> None:
        """``build`` makes zero slots that the steps then update (the same objects)."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(3), name="w")
            b = Variable(0.0, name="b")
        opt = Adam(0.1)
        opt.build([w, b])
        slots = opt.variables()
        assert [slot.name for slot in slots] == ["w/m", "w/v", "b/m", "b/v"]
        assert [[np.array(copy).tolist() for copy in s.values] for s in slots] == [
            [[0.0, 0.0, 0.0]] * 2,
            [[0.0, 0.0, 0.0]] * 2,
            [0.0, 0.0],
            [0.0, 0.0],
        ]
        assert all(isinstance(s, MirroredVariable) for s in slots)
        assert all(s.distribute_strategy is strategy for s in slots)
        opt.build([b, w])  # already built: nothing new
        assert opt.variables() == slots
        assert opt.iterations == 0
        ref = Reference("adam", 0.1)
        ref.add("w", np.ones(3))
        ref.add("b", 0.0)
        await train_step(strategy, opt, [w, b], [[np.ones(3), 1.0], [np.ones(3), 2.0]])
        ref.apply({"w": np.full(3, 2.0), "b": np.array(3.0)})
        assert all(a is b_ for a, b_ in zip(opt.variables(), slots, strict=True))
        assert_matches(opt, [w, b], ref)

    def test_build_rejects_non_variables(self) -> None:
        """``build`` takes aioreplica Variables only, and makes no slot when one item is
        not (not even for the variables before it)."""
        opt = Adam()
        with pytest.raises(
            TypeError, match=re.escape("expected an aioreplica.Variable, got ndarray")
        ):
            opt.build([Variable(np.ones(2), name="w"), np.zeros(2)])  # type: ignore[list-item]
        assert opt.variables() == []

    def test_ordinary_variable_gets_ordinary_slots(self) -> None:
        """Slots of a variable made outside any scope are ordinary variables too."""
        w = Variable(np.ones(2), name="w")
        opt = SGD(0.1, momentum=0.9)
        opt.build([w])
        slot = opt.get_slot(w, "momentum")
        assert type(slot) is Variable
        assert slot.distribute_strategy is None
        assert slot.devices == w.devices
        assert slot.numpy().tolist() == [0.0, 0.0]

    async def test_sgd_without_momentum_has_no_slots(self) -> None:
        """Plain SGD keeps nothing per variable; asking for "momentum" names its slots."""
        w = Variable(np.ones(2), name="w")
        opt = SGD(0.1)
        await opt.apply_gradients([(np.ones(2), w)])
        opt.build([w])
        assert opt.variables() == []
        with pytest.raises(
            ValueError, match=re.escape("SGD has no slot 'momentum'; its slots are []")
        ):
            opt.get_slot(w, "momentum")

    def test_unknown_slot_name(self) -> None:
        """An unknown slot name is a ValueError listing the valid ones."""
        w = Variable(np.ones(2), name="w")
        opt = Adam()
        opt.build([w])
        with pytest.raises(
            ValueError, match=re.escape("Adam has no slot 'velocity'; its slots are ['m', 'v']")
        ):
            opt.get_slot(w, "velocity")

    def test_variable_without_slots(self) -> None:
        """A variable the optimizer has not seen has no slots: ValueError naming it."""
        w = Variable(np.ones(2), name="w")
        other = Variable(np.ones(2), name="other")
        opt = SGD(0.1, momentum=0.5)
        opt.build([w])
        with pytest.raises(ValueError, match="SGD has no slots for variable 'other' yet"):
            opt.get_slot(other, "momentum")


# -- errors ----------------------------------------------------------------------------


class TestErrors:
    @staticmethod
    async def trained() -> tuple[MirroredStrategy, list[Variable], Optimizer]:
        """A 2-replica strategy with variables w (3,) and b () after one Adam step."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(3), name="w")
            b = Variable(2.0, name="b")
        opt = Adam(0.1)
        await train_step(strategy, opt, [w, b], [[np.ones(3), 1.0], [np.ones(3), 0.5]])
        return strategy, [w, b], opt

    async def test_wrong_gradient_shape_names_variable_and_replica(self) -> None:
        """A gradient of the wrong shape on one replica is a ValueError; nothing changes."""
        strategy, variables, opt = await self.trained()
        before = snapshot(opt, variables)
        grads = [[np.ones(3), 1.0], [np.ones(2), 1.0]]
        with pytest.raises(
            ValueError,
            match=re.escape(
                "apply_gradients(): the gradient of variable 'w' from replica 1 has shape "
                "(2,), but the variable has shape (3,)"
            ),
        ):
            await train_step(strategy, opt, variables, grads)
        assert_unchanged(before, snapshot(opt, variables))

    async def test_gradient_dtype_that_cannot_be_cast(self) -> None:
        """A complex gradient for a float64 variable is a TypeError; nothing changes."""
        strategy, variables, opt = await self.trained()
        before = snapshot(opt, variables)
        grads: list[list[Any]] = [[np.ones(3), 1.0], [np.ones(3), np.complex128(1 + 1j)]]
        with pytest.raises(
            TypeError,
            match=re.escape(
                "apply_gradients(): the gradient of variable 'b' from replica 1 has dtype "
                "complex128, which cannot be cast to the variable's float64"
            ),
        ):
            await train_step(strategy, opt, variables, grads)
        assert_unchanged(before, snapshot(opt, variables))

    async def test_ragged_gradient_names_variable_and_replica(self) -> None:
        """A gradient that is no array (a ragged list) is a ValueError naming the variable
        and the replica; nothing changes."""
        strategy, variables, opt = await self.trained()
        before = snapshot(opt, variables)
        grads: list[list[Any]] = [[np.ones(3), 1.0], [[[1.0, 2.0], [3.0]], 1.0]]
        with pytest.raises(
            ValueError,
            match=re.escape(
                "apply_gradients(): the gradient of variable 'w' from replica 1 is no array "
                "(setting an array element with a sequence."
            ),
        ) as caught:
            await train_step(strategy, opt, variables, grads)
        assert str(caught.value).endswith(
            "; pass an array (or a nested list) of the variable's shape (3,)"
        )
        assert isinstance(caught.value.__cause__, ValueError)
        assert_unchanged(before, snapshot(opt, variables))

    async def test_gradient_none_on_some_replicas_only(self) -> None:
        """A variable whose gradient is None on some replicas but not on the others is a
        ValueError naming it and those replicas; nothing changes. None on every replica
        still skips the variable."""
        strategy = MirroredStrategy(host_devices(3))
        with strategy.scope():
            w = Variable(np.ones(2), name="w")
            b = Variable(np.ones(2), name="b")
            c = Variable(np.ones(2), name="c")
            unused = Variable(np.ones(2), name="unused")
        opt = SGD(0.1, momentum=0.5)
        none_on: dict[str, set[int]] = {"b": {1}, "c": {0, 2}, "unused": {0, 1, 2}}

        async def step() -> int:
            ctx = aioreplica.get_replica_context()
            assert ctx is not None
            replica = ctx.replica_id_in_sync_group
            return await opt.apply_gradients(
                (None if replica in none_on.get(v.name, ()) else np.ones(2), v)
                for v in (w, b, c, unused)
            )

        before = snapshot(opt, [w, b, c, unused])
        with pytest.raises(
            ValueError,
            match=re.escape(
                "apply_gradients(): some replicas passed None for a gradient that others "
                "passed: 'b' (None on replica 1, not on replicas 0 and 2), 'c' (None on "
                "replicas 0 and 2, not on replica 1); every replica must pass a gradient for "
                "the same variables: pass zeros for a variable that a replica's loss does not "
                "depend on"
            ),
        ):
            await strategy.run(step)
        assert_unchanged(before, snapshot(opt, [w, b, c, unused]))
        none_on = {"unused": {0, 1, 2}}
        assert await strategy.run(step) == 1
        assert_close([v.numpy() for v in (w, b, c, unused)], [[0.7, 0.7]] * 3 + [[1.0, 1.0]])
        assert [slot.name for slot in opt.variables()] == ["w/momentum", "b/momentum", "c/momentum"]

    async def test_variable_listed_twice(self) -> None:
        """The same variable twice is a ValueError; nothing changes."""
        strategy, (w, b), opt = await self.trained()
        before = snapshot(opt, [w, b])

        async def step() -> int:
            return await opt.apply_gradients([(np.ones(3), w), (1.0, b), (np.ones(3), w)])

        with pytest.raises(
            ValueError,
            match=re.escape(
                "apply_gradients(): variable 'w' is listed twice; sum its gradients first"
            ),
        ):
            await strategy.run(step)
        assert_unchanged(before, snapshot(opt, [w, b]))

    async def test_no_gradients(self) -> None:
        """Pairs whose gradients are all None are a ValueError; nothing changes."""
        strategy, (w, b), opt = await self.trained()
        before = snapshot(opt, [w, b])

        async def step() -> int:
            return await opt.apply_gradients([(None, w), (None, b)])

        with pytest.raises(
            ValueError,
            match=re.escape(
                "apply_gradients() got no gradients: every one of its 2 pairs' gradient is None"
            ),
        ):
            await strategy.run(step)
        assert_unchanged(before, snapshot(opt, [w, b]))

    async def test_an_empty_list_changes_nothing(self) -> None:
        """TF's test_empty_var_list: no pairs at all is a step that does nothing (the step
        count unchanged); it still takes its merge round, where a replica passing pairs
        would be told that the others passed none."""
        strategy, (w, b), opt = await self.trained()
        before = snapshot(opt, [w, b])
        merges = strategy.statistics().merge_rounds_completed

        async def step() -> int:
            return await opt.apply_gradients([])

        assert (
            strategy.experimental_local_results(await strategy.run(step))
            == (opt.iterations,) * strategy.num_replicas_in_sync
        )
        assert strategy.statistics().merge_rounds_completed == merges + 1
        assert_unchanged(before, snapshot(opt, [w, b]))

    @pytest.mark.parametrize(
        ("item", "message"),
        [
            pytest.param(
                lambda w: np.ones(3),
                "apply_gradients() takes (gradient, variable) pairs, got ndarray",
                id="bare-gradient",
            ),
            pytest.param(
                lambda w: (np.ones(3), w, 1),
                "apply_gradients() takes (gradient, variable) pairs, got tuple",
                id="triple",
            ),
            pytest.param(
                lambda w: (np.ones(3), np.ones(3)),
                "expected an aioreplica.Variable, got ndarray",
                id="not-a-variable",
            ),
            pytest.param(
                lambda w: (np.ones(3), "w"),
                "expected an aioreplica.Variable, got str",
                id="name-not-variable",
            ),
        ],
    )
    async def test_malformed_items(self, item: Callable[[Variable], Any], message: str) -> None:
        """Items that are not (gradient, Variable) pairs are a TypeError; nothing changes."""
        strategy, (w, b), opt = await self.trained()
        before = snapshot(opt, [w, b])

        async def step() -> int:
            return await opt.apply_gradients([(1.0, b), item(w)])

        with pytest.raises(TypeError, match=re.escape(message)):
            await strategy.run(step)
        assert_unchanged(before, snapshot(opt, [w, b]))

    @pytest.mark.parametrize(
        ("given", "message"),
        [
            (5, "apply_gradients() takes an iterable of (gradient, variable) pairs, got int 5"),
            ("w", "apply_gradients() takes an iterable of (gradient, variable) pairs, got str"),
            (None, "apply_gradients() takes an iterable of (gradient, variable) pairs, got None"),
        ],
    )
    async def test_not_an_iterable_of_pairs(self, given: Any, message: str) -> None:
        """What is no iterable of pairs at all is a TypeError saying what is needed."""
        strategy, (w, b), opt = await self.trained()
        before = snapshot(opt, [w, b])

        async def step() -> int:
            return await opt.apply_gradients(given)

        with pytest.raises(TypeError, match=re.escape(message)):
            await strategy.run(step)
        assert_unchanged(before, snapshot(opt, [w, b]))

    async def test_a_string_gradient_names_its_dtype(self) -> None:
        """A string for a gradient of shape (3,) is named by its dtype, not its shape."""
        strategy, (w, _), opt = await self.trained()

        async def step() -> int:
            return await opt.apply_gradients([("x", w)])

        with pytest.raises(TypeError, match=r"gradient of variable 'w' .* has dtype <U1, which"):
            await strategy.run(step)

    async def test_cross_replica_context(self) -> None:
        """``apply_gradients`` inside ``strategy.scope()`` is a RuntimeError; nothing changes."""
        strategy, (w, b), opt = await self.trained()
        before = snapshot(opt, [w, b])
        with (
            strategy.scope(),
            pytest.raises(
                RuntimeError,
                match=re.escape(
                    "apply_gradients() was called in cross-replica context; call it from the "
                    "step function inside strategy.run()"
                ),
            ),
        ):
            await opt.apply_gradients([(np.ones(3), w), (1.0, b)])
        assert_unchanged(before, snapshot(opt, [w, b]))

    async def test_variable_from_outside_any_scope(self) -> None:
        """An ordinary variable trained in a 2-replica run is a ValueError; nothing changes."""
        strategy, (w, b), opt = await self.trained()
        plain = Variable(np.ones(2), name="plain")
        before = snapshot(opt, [w, b, plain])

        async def step() -> int:
            return await opt.apply_gradients([(np.ones(3), w), (np.ones(2), plain)])

        with pytest.raises(
            ValueError,
            match=re.escape(
                "variable 'plain' was created outside any strategy scope, but is trained in "
                "MirroredStrategy(devices=['cpu:0', 'cpu:1']); create model variables inside "
                "`with strategy.scope():`"
            ),
        ):
            await strategy.run(step)
        assert_unchanged(before, snapshot(opt, [w, b, plain]))

    @pytest.mark.parametrize(
        ("devices", "trained_in"),
        [
            (["cpu:2", "cpu:3"], "MirroredStrategy"),
            (["cpu:0", "cpu:1"], "another MirroredStrategy"),  # says they are two
        ],
    )
    async def test_variable_of_another_strategy(self, devices: list[str], trained_in: str) -> None:
        """A variable of another strategy is a ValueError naming both (and saying they are
        two strategy objects when their devices are the same); nothing changes."""
        strategy, (w, b), opt = await self.trained()
        other = MirroredStrategy(devices)
        with other.scope():
            foreign = Variable(np.ones(2), name="foreign")
        before = snapshot(opt, [w, b, foreign])

        async def step() -> int:
            return await opt.apply_gradients([(np.ones(3), w), (np.ones(2), foreign)])

        twins = ": two strategy objects over the same devices" if devices[0] == "cpu:0" else ""
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"variable 'foreign' belongs to MirroredStrategy(devices={devices!r}), but is "
                f"trained in {trained_in}(devices=['cpu:0', 'cpu:1']){twins}; train each "
                "variable with the strategy that created it"
            ),
        ):
            await strategy.run(step)
        assert_unchanged(before, snapshot(opt, [w, b, foreign]))

    async def test_failed_first_step_makes_no_slots(self) -> None:
        """A first step that fails leaves no slots behind and the step count at 0."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(3), name="w")
        opt = SGD(0.1, momentum=0.9)
        with pytest.raises(ValueError, match="from replica 0 has shape"):
            await train_step(strategy, opt, [w], [[np.ones(4)], [np.ones(3)]])
        assert (opt.variables(), opt.iterations) == ([], 0)
        assert [copy.tolist() for copy in w.values] == [[1.0, 1.0, 1.0]] * 2

    @pytest.mark.parametrize(
        ("cls", "kwargs", "error", "message"),
        [
            (SGD, {"momentum": 1.5}, ValueError, "momentum must be in [0, 1], got 1.5"),
            (SGD, {"momentum": -0.1}, ValueError, "momentum must be in [0, 1], got -0.1"),
            (Adam, {"beta_1": 1.0}, ValueError, "beta_1 must be in [0, 1), got 1.0"),
            (Adam, {"beta_2": -0.5}, ValueError, "beta_2 must be in [0, 1), got -0.5"),
            (Adam, {"epsilon": 0}, ValueError, "epsilon must be > 0, got 0"),
            (Adam, {"epsilon": -1e-7}, ValueError, "epsilon must be > 0, got -1e-07"),
            (SGD, {"learning_rate": "x"}, TypeError, "learning_rate must be a number, got str 'x'"),
            (SGD, {"learning_rate": True}, TypeError, "learning_rate must be a number, got bool"),
            (
                Adam,
                {"learning_rate": math.nan},
                ValueError,
                "learning_rate must be finite, got nan",
            ),
            (SGD, {"learning_rate": math.inf}, ValueError, "learning_rate must be finite, got inf"),
            (SGD, {"momentum": "0.9"}, TypeError, "momentum must be a number, got str '0.9'"),
            (Adam, {"beta_1": math.nan}, ValueError, "beta_1 must be finite, got nan"),
            (AdamW, {"beta_2": 1.0}, ValueError, "beta_2 must be in [0, 1), got 1.0"),
            (
                AdamW,
                {"weight_decay": -0.1},
                ValueError,
                "weight_decay must be >= 0 (0: no decay), got -0.1",
            ),
            (AdamW, {"weight_decay": math.inf}, ValueError, "weight_decay must be finite, got inf"),
            (
                AdamW,
                {"weight_decay": None},
                ValueError,
                "weight_decay must be a number, got None",
            ),
            (
                SGD,
                {"clipnorm": 1.0, "global_clipnorm": 2.0},
                ValueError,
                "clipnorm=1.0 and global_clipnorm=2.0 were both given; pick one: clipnorm clips "
                "each gradient by its own norm, global_clipnorm all of them by their joint norm",
            ),
            (
                AdamW,
                {"clipnorm": 0.5, "global_clipnorm": 0.5},
                ValueError,
                "clipnorm=0.5 and global_clipnorm=0.5 were both given; pick one",
            ),
            (
                Adam,
                {"clipnorm": -0.5},
                ValueError,
                "clipnorm must be >= 0 (0 or None: no clipping), got -0.5",
            ),
            (
                SGD,
                {"global_clipnorm": -1.0},
                ValueError,
                "global_clipnorm must be >= 0 (0 or None: no clipping), got -1.0",
            ),
            (SGD, {"clipnorm": math.inf}, ValueError, "clipnorm must be finite, got inf"),
            (AdamW, {"global_clipnorm": math.nan}, ValueError, "global_clipnorm must be finite"),
            (Adam, {"clipnorm": "1"}, TypeError, "clipnorm must be a number, got str '1'"),
            (
                Adagrad,
                {"initial_accumulator_value": -0.1},
                ValueError,
                "initial_accumulator_value must be >= 0, got -0.1",
            ),
            (
                Adagrad,
                {"initial_accumulator_value": math.inf},
                ValueError,
                "initial_accumulator_value must be finite, got inf",
            ),
            (
                Adagrad,
                {"initial_accumulator_value": "0.1"},
                TypeError,
                "initial_accumulator_value must be a number, got str '0.1'",
            ),
            (Adagrad, {"epsilon": 0}, ValueError, "epsilon must be > 0, got 0"),
            (Adagrad, {"epsilon": -1e-7}, ValueError, "epsilon must be > 0, got -1e-07"),
            (Adagrad, {"epsilon": math.nan}, ValueError, "epsilon must be finite, got nan"),
            (Adagrad, {"learning_rate": None}, TypeError, "learning_rate must be a number"),
            (
                Adagrad,
                {"clipnorm": -1},
                ValueError,
                "clipnorm must be >= 0 (0 or None: no clipping)",
            ),
            (RMSprop, {"rho": 1.5}, ValueError, "rho must be in [0, 1], got 1.5"),
            (RMSprop, {"rho": -0.1}, ValueError, "rho must be in [0, 1], got -0.1"),
            (SGD, {"nesterov": "no"}, TypeError, "nesterov must be True or False, got 'no'"),
            (SGD, {"nesterov": 1}, TypeError, "nesterov must be True or False, got 1"),
            (
                RMSprop,
                {"centered": "False"},
                TypeError,
                "centered must be True or False, got 'False'",
            ),
            (RMSprop, {"centered": None}, TypeError, "centered must be True or False, got None"),
            (RMSprop, {"rho": math.nan}, ValueError, "rho must be finite, got nan"),
            (RMSprop, {"momentum": 1.5}, ValueError, "momentum must be in [0, 1], got 1.5"),
            (RMSprop, {"momentum": -0.5}, ValueError, "momentum must be in [0, 1], got -0.5"),
            (RMSprop, {"momentum": None}, TypeError, "momentum must be a number, got NoneType"),
            (RMSprop, {"epsilon": 0.0}, ValueError, "epsilon must be > 0, got 0.0"),
            (RMSprop, {"epsilon": -1}, ValueError, "epsilon must be > 0, got -1"),
            (
                RMSprop,
                {"clipnorm": 1.0, "global_clipnorm": 1.0},
                ValueError,
                "clipnorm=1.0 and global_clipnorm=1.0 were both given; pick one",
            ),
        ],
    )
    def test_invalid_hyperparameters(
        self, cls: type[Optimizer], kwargs: dict[str, Any], error: type[Exception], message: str
    ) -> None:
        """Out-of-range or non-numeric hyperparameters fail at construction."""
        with pytest.raises(error, match=re.escape(message)):
            cls(**kwargs)

    def test_invalid_iterations(self) -> None:
        """``iterations`` must be an int from 0 to 2**63 - 1, what a checkpoint keeps (a
        value of another type is a TypeError); a refused value leaves the count as it was."""
        opt = SGD(0.1)
        opt.iterations = 7
        refused = []
        for bad in (-1, 2**63, 2**64, True, 1.5, "3", None):
            with pytest.raises((TypeError, ValueError)) as info:
                opt.iterations = bad  # type: ignore[assignment]
            refused.append((type(info.value), str(info.value)))
        requirement = "iterations must be an int from 0 to 9223372036854775807 (2**63 - 1), got"
        assert refused == [
            (ValueError, f"{requirement} -1"),
            (ValueError, f"{requirement} {2**63}"),
            (ValueError, f"{requirement} {2**64}"),
            (TypeError, f"{requirement} bool True"),
            (TypeError, f"{requirement} float 1.5"),
            (TypeError, f"{requirement} str '3'"),
            (TypeError, f"{requirement} NoneType None"),
        ]
        assert opt.iterations == 7
        opt.iterations = np.int64(3)  # type: ignore[assignment]
        assert opt.iterations == 3
        assert type(opt.iterations) is int
        opt.iterations = 2**63 - 1
        assert opt.iterations == 2**63 - 1


# -- the default context -------------------------------------------------------------------


class TestDefaultContext:
    @pytest.mark.parametrize(("kind", "learning_rate", "config"), OPTIMIZERS)
    async def test_ordinary_variables_train_without_strategy(
        self, kind: str, learning_rate: float, config: dict[str, Any]
    ) -> None:
        """Outside any strategy, ``apply_gradients`` updates ordinary variables directly."""
        rng = np.random.default_rng(7)
        w = Variable(rng.normal(size=(2, 3)), name="w")
        b = Variable(rng.normal(size=3), name="b")
        opt = make_optimizer(kind, learning_rate, config)
        ref = Reference(kind, learning_rate, **config)
        ref.add("w", w.numpy())
        ref.add("b", b.numpy())
        assert aioreplica.get_replica_context() is not None
        for step in range(1, 5):
            gw, gb = rng.normal(size=(2, 3)), rng.normal(size=3)
            assert await opt.apply_gradients([(gw, w), (gb, b)]) == step
            ref.apply({"w": gw, "b": gb})
            assert_matches(opt, [w, b], ref)
        assert all(type(slot) is Variable for slot in opt.variables())

    async def test_one_replica_strategy_rejects_ordinary_variable(self) -> None:
        """A one-replica strategy of one's own is not the default: scope variables needed."""
        strategy = MirroredStrategy(["cpu:0"])
        w = Variable(np.ones(2), name="w")
        opt = SGD(0.1)

        async def step() -> int:
            return await opt.apply_gradients([(np.ones(2), w)])

        with pytest.raises(ValueError, match="was created outside any strategy scope"):
            await strategy.run(step)
        assert w.numpy().tolist() == [1.0, 1.0]

    async def test_mirrored_variable_outside_run(self) -> None:
        """A strategy's variable trained in the default context is a ValueError; no change."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(2), name="w")
        opt = SGD(0.1, momentum=0.5)
        with pytest.raises(
            ValueError,
            match=re.escape(
                "apply_gradients() was called outside strategy.run() for variable 'w' of "
                "MirroredStrategy(devices=['cpu:0', 'cpu:1']); call it from the step function "
                "inside strategy.run(), where each replica passes its gradients"
            ),
        ):
            await opt.apply_gradients([(np.ones(2), w)])
        assert [copy.tolist() for copy in w.values] == [[1.0, 1.0]] * 2
        assert (opt.variables(), opt.iterations) == ([], 0)


class GatedDevice(FakeDevice):
    """A host device whose work waits until its ``gate`` is set."""

    def __init__(self, name: str, index: int, gate: anyio.Event) -> None:
        super().__init__(name, index, inline=True)
        self.gate = gate

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        await self.gate.wait()
        return await super().run(fn, *args, **kwargs)


def belongs_to(optimizer: str, stepper: str, owner: str, how: str) -> str:
    return (
        f"apply_gradients() of {optimizer} was called in {stepper}, but this optimizer belongs "
        f"to {owner} ({how}); its slots and step count are that strategy's, and nothing was "
        "changed: create one optimizer per strategy, inside `with strategy.scope():`"
    )


DEFAULT = "the default strategy MirroredStrategy(devices=['cpu:0']) (outside any strategy.run())"


class TestOneStrategy:
    """An optimizer belongs to the strategy it was created in the scope of, else to that of
    its first step: a step elsewhere is refused, naming both, before anything changes."""

    @pytest.mark.parametrize("bound_by", ["scope", "first step"])
    async def test_a_step_in_another_strategy_is_refused(self, bound_by: str) -> None:
        """Adam bound to A, then stepped in B's run (even over A's devices) or outside any
        run: a ValueError naming both; B's variable, the slots and the step count stay."""
        a = MirroredStrategy(host_devices(2))
        b = MirroredStrategy(["cpu:2", "cpu:3", "cpu:4"])
        twin = MirroredStrategy(host_devices(2))
        with a.scope():
            va = Variable(np.zeros(2), name="va")
            opt = Adam(0.1) if bound_by == "scope" else None
        opt = opt or Adam(0.1)
        with b.scope():
            vb = Variable(np.zeros(2), name="vb")
        with twin.scope():
            vt = Variable(np.zeros(2), name="vt")
        plain = Variable(np.zeros(2), name="plain")
        ref = Reference("adam", 0.1)
        ref.add("va", va.numpy())
        if bound_by == "first step":
            await train_step(a, opt, [va], [[np.ones(2)], [np.ones(2)]])
            ref.apply({"va": np.full(2, 2.0)})
        how = "it was created in its scope" if bound_by == "scope" else "its first step was in it"
        owner = "MirroredStrategy(devices=['cpu:0', 'cpu:1'])"
        before = snapshot(opt, [va, vb, vt, plain])
        calls = [
            (b, vb, "MirroredStrategy(devices=['cpu:2', 'cpu:3', 'cpu:4'])"),
            (twin, vt, f"another {owner}: two strategy objects over the same devices"),
            (None, plain, DEFAULT),
        ]

        async def step(strategy: MirroredStrategy | None, variable: Variable) -> Any:
            if strategy is None:
                return await opt.apply_gradients([(np.ones(2), variable)])
            grads = [[np.ones(2)]] * strategy.num_replicas_in_sync
            return await train_step(strategy, opt, [variable], grads)

        for strategy, variable, stepper in calls:
            message = belongs_to("Adam", stepper, owner, how)
            with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
                await step(strategy, variable)
        assert_unchanged(before, snapshot(opt, [va, vb, vt, plain]))
        # Still A's: its steps go on, with A's step count (Adam's bias correction).
        await train_step(a, opt, [va], [[np.ones(2)], [np.ones(2)]])
        ref.apply({"va": np.full(2, 2.0)})
        assert_matches(opt, [va], ref)

    async def test_a_first_step_outside_any_run_binds_to_the_default(self) -> None:
        """Plain variables trained outside any run: the optimizer is the default strategy's,
        and a strategy's run cannot step it."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.zeros(2), name="w")
        opt = SGD(0.1)
        await opt.apply_gradients([(np.ones(2), Variable(np.zeros(2), name="plain"))])
        message = belongs_to(
            "SGD",
            "MirroredStrategy(devices=['cpu:0', 'cpu:1'])",
            DEFAULT,
            "its first step was in it",
        )
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            await train_step(strategy, opt, [w], [[np.ones(2)], [np.ones(2)]])
        assert (opt.iterations, w.numpy().tolist()) == (1, [0.0, 0.0])

    async def test_a_failed_or_empty_first_step_binds_nothing(self) -> None:
        """Only a step that changes something decides: after a refused first step in B and an
        empty one, A's run can still step the optimizer."""
        a = MirroredStrategy(host_devices(2))
        b = MirroredStrategy(["cpu:2", "cpu:3"])
        with a.scope():
            va = Variable(np.zeros(2), name="va")
        with b.scope():
            vb = Variable(np.zeros(2), name="vb")
        opt = SGD(0.5)
        with pytest.raises(ValueError, match="has shape"):
            await train_step(b, opt, [vb], [[np.ones(3)], [np.ones(3)]])
        await b.run(opt.apply_gradients, ([],))
        assert await train_step(a, opt, [va], [[np.ones(2)], [np.ones(2)]]) == 1
        assert [copy.tolist() for copy in va.values] == [[-1.0, -1.0]] * 2

    async def test_concurrent_first_steps_in_two_strategies(self) -> None:
        """Two first steps in two strategies at once: the first to commit decides; the other,
        checked again once it holds its turn, is refused and changes nothing."""
        gate = anyio.Event()
        a = MirroredStrategy([GatedDevice(f"gated:{i}", i, gate) for i in range(2)])
        b = MirroredStrategy(["cpu:2", "cpu:3"])
        with a.scope():
            va = Variable(np.zeros(2), name="va")
        with b.scope():
            vb = Variable(np.zeros(2), name="vb")
        opt = SGD(0.5, momentum=0.5)
        events: list[str] = []

        async def train(name: str, strategy: MirroredStrategy, variable: Variable) -> None:
            try:
                await train_step(strategy, opt, [variable], [[np.ones(2)], [np.ones(2)]])
                events.append(f"{name} stepped")
            except ValueError as error:
                events.append(f"{name}: {error}")

        async with anyio.create_task_group() as group:
            group.start_soon(train, "a", a, va)
            await anyio.wait_all_tasks_blocked()  # a's step holds its turn, waiting on its devices
            group.start_soon(train, "b", b, vb)
            await anyio.wait_all_tasks_blocked()  # b's step waits for its turn
            gate.set()
        assert sorted(events) == [  # the runs' callers resume in either order
            "a stepped",
            "b: "
            + belongs_to(
                "SGD",
                "MirroredStrategy(devices=['cpu:2', 'cpu:3'])",
                "MirroredStrategy(devices=['gated:0', 'gated:1'])",
                "its first step was in it",
            ),
        ]
        assert opt.iterations == 1
        assert [copy.tolist() for copy in vb.values] == [[0.0, 0.0]] * 2
        assert [slot.name for slot in opt.variables()] == ["va/momentum"]


# -- all or nothing --------------------------------------------------------------------------


class DeviceLost(Exception):
    pass


class Trap:
    """Where a ``TrapDevice`` stops: the update of ``target``'s copy, blocking or raising."""

    def __init__(self, watch: Sequence[Variable]) -> None:
        self.watch = list(watch)
        self.target: Variable | None = None
        self.error: BaseException | None = None
        self.reached = anyio.Event()
        self.never = anyio.Event()
        self.updated: list[str] = []


class TrapDevice(FakeDevice):
    """A host-backed device whose ``run`` of a watched variable's update can block or raise."""

    def __init__(self, index: int, trap: Trap) -> None:
        super().__init__(f"cpu:{index}", index)
        self.trap = trap

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        trap = self.trap
        for variable in trap.watch:  # a job updating several variables has all their copies
            if any(arg is copy for arg in args for copy in variable.values):
                trap.updated.append(variable.name)
                if variable is trap.target:
                    if trap.error is not None:
                        raise trap.error
                    trap.reached.set()
                    await trap.never.wait()
        return await super().run(fn, *args, **kwargs)


class TestAllOrNothing:
    @staticmethod
    def setup(clip: dict[str, Any]) -> tuple[MirroredStrategy, list[Variable], Trap, Reference]:
        trap = Trap([])
        strategy = MirroredStrategy([TrapDevice(i, trap) for i in range(2)])
        with strategy.scope():
            w = Variable(np.ones(3), name="w")
            b = Variable(np.array([2.0, -1.0]), name="b")
        trap.watch = [w, b]
        ref = Reference("adam", 0.1, **clip)
        ref.add("w", np.ones(3))
        ref.add("b", [2.0, -1.0])
        return strategy, [w, b], trap, ref

    # The summed gradients have norms 4.5 and 2.8: clipping to 2 changes both.
    CLIPS: ClassVar[list[Any]] = [
        pytest.param({}, id="unclipped"),
        pytest.param({"clipnorm": 2.0}, id="clipnorm"),
        pytest.param({"global_clipnorm": 2.0}, id="global_clipnorm"),
    ]

    GRADS: tuple[list[Any], list[Any]] = (
        [np.array([1.0, 2.0, 3.0]), np.array([0.5, 0.5])],
        [np.array([-1.0, 0.0, 1.0]), np.array([1.5, -2.5])],
    )

    @pytest.mark.parametrize("clip", CLIPS)
    @pytest.mark.parametrize("steps_before", [0, 1])
    async def test_cancelled_inside_second_update(
        self, steps_before: int, clip: dict[str, Any]
    ) -> None:
        """Cancelled while the second variable's copy is updated: no copy, slot or count moved."""
        strategy, variables, trap, ref = self.setup(clip)
        opt = Adam(0.1, **clip)
        for _ in range(steps_before):
            await train_step(strategy, opt, variables, self.GRADS)
            ref.apply(summed(self.GRADS, ["w", "b"]))
        before = snapshot(opt, variables)
        trap.updated.clear()
        trap.target = variables[1]
        async with anyio.create_task_group() as tg:
            tg.start_soon(train_step, strategy, opt, variables, self.GRADS)
            await trap.reached.wait()
            tg.cancel_scope.cancel()
        assert trap.updated[0] == "w"
        assert trap.updated[-1] == "b"
        assert_unchanged(before, snapshot(opt, variables))
        assert opt.iterations == steps_before
        assert strategy.statistics().runs_active == 0
        # The optimizer carries on from the state before the cancelled step.
        trap.target = None
        assert await train_step(strategy, opt, variables, self.GRADS) == steps_before + 1
        ref.apply(summed(self.GRADS, ["w", "b"]))
        assert_matches(opt, variables, ref)

    @pytest.mark.parametrize("clip", CLIPS)
    @pytest.mark.parametrize("steps_before", [0, 1])
    async def test_error_in_second_update(self, steps_before: int, clip: dict[str, Any]) -> None:
        """A device error in the second variable's update fails run(); nothing changed."""
        strategy, variables, trap, ref = self.setup(clip)
        opt = Adam(0.1, **clip)
        for _ in range(steps_before):
            await train_step(strategy, opt, variables, self.GRADS)
            ref.apply(summed(self.GRADS, ["w", "b"]))
        before = snapshot(opt, variables)
        trap.updated.clear()
        trap.target = variables[1]
        trap.error = DeviceLost("device lost during update")
        with pytest.raises(DeviceLost, match="device lost during update"):
            await train_step(strategy, opt, variables, self.GRADS)
        assert trap.updated[0] == "w"
        assert trap.updated[-1] == "b"
        assert_unchanged(before, snapshot(opt, variables))
        assert opt.iterations == steps_before
        trap.target = None
        assert await train_step(strategy, opt, variables, self.GRADS) == steps_before + 1
        ref.apply(summed(self.GRADS, ["w", "b"]))
        assert_matches(opt, variables, ref)


# -- repr and config ------------------------------------------------------------------------


class TestConfig:
    def test_repr(self) -> None:
        """The repr shows the class and every hyperparameter."""
        assert repr(SGD(0.1)) == "SGD(learning_rate=0.1, momentum=0.0, nesterov=False)"
        assert repr(SGD(0.5, momentum=0.9, nesterov=True)) == (
            "SGD(learning_rate=0.5, momentum=0.9, nesterov=True)"
        )
        assert repr(Adam()) == (
            "Adam(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-07, amsgrad=False)"
        )
        assert repr(AdamW()) == (
            "AdamW(learning_rate=0.001, weight_decay=0.004, beta_1=0.9, beta_2=0.999, "
            "epsilon=1e-07, amsgrad=False)"
        )
        assert repr(Adagrad()) == (
            "Adagrad(learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-07)"
        )
        assert repr(RMSprop()) == (
            "RMSprop(learning_rate=0.001, rho=0.9, momentum=0.0, epsilon=1e-07, centered=False)"
        )

    def test_repr_shows_clipping_when_set(self) -> None:
        """Clipping shows in the repr only when it is on."""
        assert repr(SGD(0.1, clipnorm=1)) == (
            "SGD(learning_rate=0.1, momentum=0.0, nesterov=False, clipnorm=1.0)"
        )
        assert repr(AdamW(global_clipnorm=2)) == (
            "AdamW(learning_rate=0.001, weight_decay=0.004, beta_1=0.9, beta_2=0.999, "
            "epsilon=1e-07, amsgrad=False, global_clipnorm=2.0)"
        )

    def test_get_config(self) -> None:
        """``get_config`` holds the constructor's keyword arguments, as floats."""
        assert SGD(0.1).get_config() == {
            "learning_rate": 0.1,
            "momentum": 0.0,
            "nesterov": False,
            "weight_decay": None,
            "clipnorm": None,
            "global_clipnorm": None,
            "clipvalue": None,
        }
        assert Adam(0.01, beta_1=0, beta_2=0.5, epsilon=1, clipnorm=2).get_config() == {
            "learning_rate": 0.01,
            "beta_1": 0.0,
            "beta_2": 0.5,
            "epsilon": 1.0,
            "amsgrad": False,
            "weight_decay": None,
            "clipnorm": 2.0,
            "global_clipnorm": None,
            "clipvalue": None,
        }
        assert AdamW(0.01, weight_decay=1, global_clipnorm=3).get_config() == {
            "learning_rate": 0.01,
            "weight_decay": 1.0,
            "beta_1": 0.9,
            "beta_2": 0.999,
            "epsilon": 1e-7,
            "amsgrad": False,
            "clipnorm": None,
            "global_clipnorm": 3.0,
            "clipvalue": None,
        }
        assert Adagrad(0.5, initial_accumulator_value=0, epsilon=1, clipnorm=2).get_config() == {
            "learning_rate": 0.5,
            "initial_accumulator_value": 0.0,
            "epsilon": 1.0,
            "weight_decay": None,
            "clipnorm": 2.0,
            "global_clipnorm": None,
            "clipvalue": None,
        }
        assert RMSprop(
            0.01, rho=0, momentum=1, epsilon=0.5, centered=True, global_clipnorm=3
        ).get_config() == {
            "learning_rate": 0.01,
            "rho": 0.0,
            "momentum": 1.0,
            "epsilon": 0.5,
            "centered": True,
            "weight_decay": None,
            "clipnorm": None,
            "global_clipnorm": 3.0,
            "clipvalue": None,
        }

    def test_config_round_trips(self) -> None:
        """An optimizer rebuilt from its config has the same config; schedules are kept."""

        def schedule(step: int) -> float:
            return 0.1

        optimizers: list[Optimizer] = [
            SGD(schedule, momentum=0.3, nesterov=True),
            SGD(0.1, clipnorm=0.5),
            Adam(0.2, epsilon=1e-3, global_clipnorm=4.0),
            AdamW(schedule, weight_decay=0.01, beta_1=0.8, clipnorm=1.0),
            Adagrad(schedule, initial_accumulator_value=0.0, epsilon=1e-3),
            Adagrad(0.2, initial_accumulator_value=3.0, global_clipnorm=1.0),
            RMSprop(schedule, rho=0.5, momentum=0.9, centered=True, clipnorm=0.5),
            RMSprop(0.1, epsilon=1e-3),
        ]
        for opt in optimizers:
            rebuilt = type(opt)(**opt.get_config())
            assert rebuilt.get_config() == opt.get_config()
            assert repr(rebuilt) == repr(opt)
            assert rebuilt.slot_names == opt.slot_names
        assert SGD(schedule).get_config()["learning_rate"] is schedule
        assert AdamW(schedule).get_config()["learning_rate"] is schedule
        assert Adagrad(schedule).get_config()["learning_rate"] is schedule
        assert RMSprop(schedule).get_config()["learning_rate"] is schedule

    def test_numpy_bools_are_flags(self) -> None:
        """NumPy bools are accepted for the boolean hyperparameters, kept as Python bools."""
        sgd = SGD(0.1, momentum=0.5, nesterov=np.bool_(True))  # type: ignore[arg-type]
        rmsprop = RMSprop(0.1, centered=np.bool_(True))  # type: ignore[arg-type]
        assert (sgd.get_config()["nesterov"], rmsprop.get_config()["centered"]) == (True, True)
        assert type(sgd.get_config()["nesterov"]) is type(rmsprop.get_config()["centered"]) is bool
        assert rmsprop.slot_names == ("velocity", "average_gradient")

    def test_public_names(self) -> None:
        """The classes are public as ``aioreplica.optimizers.*``."""
        assert aioreplica.optimizers.SGD is SGD
        assert aioreplica.optimizers.Adam is Adam
        assert issubclass(SGD, aioreplica.optimizers.Optimizer)
        assert issubclass(Adam, aioreplica.optimizers.Optimizer)
        assert aioreplica.optimizers.AdamW is AdamW
        assert AdamW.__module__ == "aioreplica.optimizers"
        # As in Keras, AdamW is an Adam (with decoupled weight decay).
        assert issubclass(AdamW, Adam)
        for cls in (Adagrad, RMSprop):
            assert getattr(aioreplica.optimizers, cls.__name__) is cls
            assert issubclass(cls, Optimizer)
            assert cls.__module__ == "aioreplica.optimizers"
