"""Keras 3's optimizer arguments: ``amsgrad``, ``clipvalue``, ``weight_decay`` and
``exclude_from_weight_decay``, and learning rates that are 0-d arrays, each step checked
against Keras 3's formulas."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pytest
from test_optimizers import train_step

from aioreplica import Checkpoint, CheckpointError, MirroredStrategy, Variable
from aioreplica.optimizers import SGD, Adagrad, Adam, AdamW, Optimizer, RMSprop
from aioreplica.testing import FakeDevice, host_devices

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

pytestmark = pytest.mark.anyio

T = TypeVar("T")
Array = np.ndarray[Any, Any]

CLASSES: dict[str, type[Optimizer]] = {
    "sgd": SGD,
    "adam": Adam,
    "adamw": AdamW,
    "adagrad": Adagrad,
    "rmsprop": RMSprop,
}


# -- the reference: Keras 3 in plain float64 NumPy -----------------------------------------


class Keras3:
    """Keras 3's ``BaseOptimizer.apply`` on summed gradients, in float64 NumPy.

    In Keras' order: ``_clip_gradients`` (``clipnorm``, else ``global_clipnorm``, else
    ``clipvalue``), then ``_apply_weight_decay`` (``w - w * weight_decay * lr`` for every
    variable whose name contains none of ``excluded``), then each ``update_step``.
    """

    def __init__(
        self,
        kind: str,
        learning_rate: float | Callable[[int], float],
        excluded: Sequence[str] = (),
        **config: Any,
    ) -> None:
        self.kind = kind
        self.learning_rate = learning_rate
        self.excluded = tuple(excluded)
        self.config = config
        self.iterations = 0
        self.params: dict[str, Array] = {}
        self.slots: dict[str, dict[str, Array]] = {}

    def tracking(self, variables: Sequence[Variable]) -> Keras3:
        for variable in variables:
            self.params[variable.name] = np.array(variable.numpy(), dtype=np.float64)
        return self

    def clip(self, grads: dict[str, Array]) -> dict[str, Array]:
        clipnorm = self.config.get("clipnorm")
        global_clipnorm = self.config.get("global_clipnorm")
        clipvalue = self.config.get("clipvalue")
        if clipnorm is not None:
            return {
                name: g * clipnorm / max(float(np.sqrt(np.sum(g * g))), clipnorm)
                for name, g in grads.items()
            }
        if global_clipnorm is not None:
            norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
            return {
                name: g * global_clipnorm / max(norm, global_clipnorm) for name, g in grads.items()
            }
        if clipvalue is not None:
            return {name: np.clip(g, -clipvalue, clipvalue) for name, g in grads.items()}
        return grads

    def slot(self, name: str, slot: str, initial: float = 0.0) -> Array:
        slots = self.slots.setdefault(name, {})
        return slots.setdefault(slot, np.full_like(self.params[name], initial))

    def apply(self, grads: dict[str, Array]) -> None:
        step = self.iterations
        lr = self.learning_rate(step) if callable(self.learning_rate) else self.learning_rate
        grads = self.clip(grads)
        weight_decay = self.config.get("weight_decay")
        if self.kind == "adamw" and weight_decay is None:
            weight_decay = 0.004
        if weight_decay is not None:
            for name, w in self.params.items():
                if name in grads and not any(part in name for part in self.excluded):
                    self.params[name] = w - w * weight_decay * lr
        for name, g in grads.items():
            self.params[name] = self.update(name, self.params[name], g, lr, step)
        self.iterations = step + 1

    def update(self, name: str, w: Array, g: Array, lr: float, step: int) -> Any:
        """The new value of variable ``name``, its slots updated (Keras' ``update_step``)."""
        config = self.config
        if self.kind == "sgd":
            momentum = config.get("momentum", 0.0)
            if not momentum:
                return w - g * lr
            m = self.slots.setdefault(name, {})["momentum"] = (
                self.slot(name, "momentum") * momentum - g * lr
            )
            if config.get("nesterov", False):
                return w + m * momentum - g * lr
            return w + m
        if self.kind in ("adam", "adamw"):
            beta_1 = config.get("beta_1", 0.9)
            beta_2 = config.get("beta_2", 0.999)
            epsilon = config.get("epsilon", 1e-7)
            t = step + 1
            alpha = lr * math.sqrt(1 - beta_2**t) / (1 - beta_1**t)
            slots = self.slots.setdefault(name, {})
            m = slots["m"] = self.slot(name, "m") + (g - self.slot(name, "m")) * (1 - beta_1)
            v = slots["v"] = self.slot(name, "v") + (g * g - self.slot(name, "v")) * (1 - beta_2)
            if config.get("amsgrad", False):
                v = slots["velocity_hat"] = np.maximum(self.slot(name, "velocity_hat"), v)
            return w - m * alpha / (np.sqrt(v) + epsilon)
        if self.kind == "adagrad":
            initial = config.get("initial_accumulator_value", 0.1)
            accumulator = self.slot(name, "accumulator", initial) + g * g
            self.slots[name]["accumulator"] = accumulator
            return w - lr * g / np.sqrt(accumulator + config.get("epsilon", 1e-7))
        rho = config.get("rho", 0.9)
        momentum = config.get("momentum", 0.0)
        slots = self.slots.setdefault(name, {})
        velocity = slots["velocity"] = rho * self.slot(name, "velocity") + (1 - rho) * g * g
        if config.get("centered", False):
            average = slots["average_gradient"] = (
                rho * self.slot(name, "average_gradient") + (1 - rho) * g
            )
            denominator = velocity - average * average + config.get("epsilon", 1e-7)
        else:
            denominator = velocity + config.get("epsilon", 1e-7)
        increment = lr * g / np.sqrt(denominator)
        if momentum > 0:
            slots["momentum"] = momentum * self.slot(name, "momentum") + increment
            return w - slots["momentum"]
        return w - increment


def tolerance(dtype: type[np.floating[Any]]) -> tuple[float, float]:
    """The relative and absolute tolerances of a comparison with the float64 reference."""
    return (1e-12, 1e-12) if dtype is np.float64 else (2e-5, 2e-6)


def assert_matches(
    opt: Optimizer, variables: Sequence[Variable], ref: Keras3, dtype: type[np.floating[Any]]
) -> None:
    """Every copy of every variable and slot equals the reference, in ``dtype``; same step."""
    assert opt.iterations == ref.iterations
    rtol, atol = tolerance(dtype)
    for variable in variables:
        for copy in variable.values:
            assert copy.dtype == dtype
            np.testing.assert_allclose(copy, ref.params[variable.name], rtol=rtol, atol=atol)
        for slot_name, value in ref.slots.get(variable.name, {}).items():
            for copy in opt.get_slot(variable, slot_name).values:
                assert copy.dtype == dtype
                np.testing.assert_allclose(copy, value, rtol=rtol, atol=atol)


SHAPES = {"dense/kernel": (3, 2), "dense/bias": (2,), "scale": ()}
# Large gradients first, then small ones: Adam's ``v`` then falls, so that AMSGrad's
# ``velocity_hat`` (its largest value so far) differs from it, and ``clipvalue`` clips early.
SCALES = (3.0, 2.0, 0.1, 0.05, 0.05)


def make_variables(
    strategy: MirroredStrategy, rng: np.random.Generator, dtype: type[np.floating[Any]]
) -> list[Variable]:
    with strategy.scope():
        return [
            Variable(rng.normal(size=shape).astype(dtype), name=name)
            for name, shape in SHAPES.items()
        ]


def random_grads(
    rng: np.random.Generator, replicas: int, scale: float, dtype: type[np.floating[Any]]
) -> list[list[Array]]:
    return [
        [(scale * rng.normal(size=shape)).astype(dtype) for shape in SHAPES.values()]
        for _ in range(replicas)
    ]


def summed(grads: Sequence[Sequence[Array]]) -> dict[str, Array]:
    """The sum over replicas of each variable's gradients, in float64."""
    return {
        name: np.sum([np.asarray(g[i], dtype=np.float64) for g in grads], axis=0)
        for i, name in enumerate(SHAPES)
    }


def halving(step: int) -> float:
    return 0.1 * 0.5**step


async def train_like_keras(
    kind: str,
    learning_rate: float | Callable[[int], float],
    config: dict[str, Any],
    replicas: int,
    dtype: type[np.floating[Any]],
    excluded: Sequence[str] = (),
) -> tuple[Optimizer, list[Variable], Keras3]:
    """Five steps on ``replicas`` replicas, each checked against Keras 3's."""
    rng = np.random.default_rng(7)
    strategy = MirroredStrategy(host_devices(replicas))
    variables = make_variables(strategy, rng, dtype)
    opt = CLASSES[kind](learning_rate, **config)
    if excluded:
        opt.exclude_from_weight_decay(var_names=excluded)
    ref = Keras3(kind, learning_rate, excluded, **config).tracking(variables)
    for scale in SCALES:
        grads = random_grads(rng, replicas, scale, dtype)
        assert await train_step(strategy, opt, variables, grads) == ref.iterations + 1
        ref.apply(summed(grads))
        assert_matches(opt, variables, ref, dtype)
    return opt, variables, ref


REPLICAS_AND_DTYPES: list[Any] = [
    pytest.param(replicas, dtype, id=f"{replicas}-{dtype.__name__}")
    for replicas in (1, 2)
    for dtype in (np.float64, np.float32)
]


# -- amsgrad -------------------------------------------------------------------------------


class TestAmsgrad:
    @pytest.mark.parametrize(("replicas", "dtype"), REPLICAS_AND_DTYPES)
    @pytest.mark.parametrize(
        ("kind", "learning_rate", "config"),
        [
            pytest.param("adam", 0.05, {"amsgrad": True}, id="adam"),
            pytest.param(
                "adam",
                halving,
                {"amsgrad": True, "beta_1": 0.5, "beta_2": 0.75, "epsilon": 1e-3},
                id="adam-custom",
            ),
            pytest.param("adamw", 0.05, {"amsgrad": True, "weight_decay": 0.2}, id="adamw"),
        ],
    )
    async def test_matches_keras(
        self,
        kind: str,
        learning_rate: float | Callable[[int], float],
        config: dict[str, Any],
        replicas: int,
        dtype: type[np.floating[Any]],
    ) -> None:
        """Five steps match Keras 3's AMSGrad, ``velocity_hat`` slot included."""
        opt, _, ref = await train_like_keras(kind, learning_rate, config, replicas, dtype)
        assert opt.slot_names == ("m", "v", "velocity_hat")
        # The test means something: the largest second moment is no longer the last one.
        slots = ref.slots["dense/kernel"]
        assert np.all(slots["velocity_hat"] >= slots["v"])
        assert np.any(slots["velocity_hat"] > slots["v"] * (1 + 1e-4))

    def test_slots_and_config(self) -> None:
        """``amsgrad`` adds Keras' ``velocity_hat`` slot and shows in the config."""
        assert Adam().slot_names == ("m", "v")
        assert Adam(amsgrad=True).slot_names == ("m", "v", "velocity_hat")
        assert AdamW(0.1, 0.01, 0.9, 0.999, 1e-7, True).slot_names == ("m", "v", "velocity_hat")
        assert Adam(amsgrad=True).get_config()["amsgrad"] is True
        with pytest.raises(TypeError, match=re.escape("amsgrad must be True or False, got 'yes'")):
            Adam(amsgrad="yes")  # type: ignore[arg-type]

    async def test_checkpoint_round_trip(self, tmp_path: Path) -> None:
        """Saved after three steps and restored into a fresh AMSGrad optimizer on another
        replica count, ``velocity_hat`` comes back and the next steps match Keras'."""
        rng = np.random.default_rng(3)
        config: dict[str, Any] = {"amsgrad": True, "weight_decay": 0.1, "clipvalue": 1.0}
        strategy = MirroredStrategy(host_devices(2))
        variables = make_variables(strategy, rng, np.float64)
        opt = Adam(halving, **config)
        ref = Keras3("adam", halving, **config).tracking(variables)
        for scale in SCALES[:3]:
            grads = random_grads(rng, 2, scale, np.float64)
            await train_step(strategy, opt, variables, grads)
            ref.apply(summed(grads))
        path = await Checkpoint(model={v.name: v for v in variables}, optimizer=opt).save(
            tmp_path / "amsgrad.npz"
        )

        strategy_1 = MirroredStrategy(host_devices(1))
        with strategy_1.scope():
            restored_vars = [Variable(np.zeros(shape), name=name) for name, shape in SHAPES.items()]
        restored = Adam(**opt.get_config())
        await Checkpoint(model={v.name: v for v in restored_vars}, optimizer=restored).restore(path)
        assert restored.slot_names == ("m", "v", "velocity_hat")
        assert_matches(restored, restored_vars, ref, np.float64)
        for scale in SCALES[3:]:
            grads = random_grads(rng, 1, scale, np.float64)
            await train_step(strategy_1, restored, restored_vars, grads)
            ref.apply(summed(grads))
            assert_matches(restored, restored_vars, ref, np.float64)

    async def test_checkpoint_does_not_restore_into_plain_adam(self, tmp_path: Path) -> None:
        """An AMSGrad checkpoint restored into an ``Adam`` without it is refused, naming the
        slots; nothing changes."""
        w = Variable(np.ones(2), name="w")
        opt = Adam(0.1, amsgrad=True)
        await opt.apply_gradients([(np.ones(2), w)])
        path = await Checkpoint(w=w, optimizer=opt).save(tmp_path / "amsgrad.npz")
        other_w = Variable(np.zeros(2), name="w")
        adam = Adam(0.1)
        with pytest.raises(CheckpointError, match="velocity_hat"):
            await Checkpoint(w=other_w, optimizer=adam).restore(path)
        assert (other_w.numpy().tolist(), adam.iterations, adam.variables()) == ([0.0, 0.0], 0, [])


# -- clipvalue -----------------------------------------------------------------------------


class TestClipValue:
    @pytest.mark.parametrize(("replicas", "dtype"), REPLICAS_AND_DTYPES)
    @pytest.mark.parametrize(
        ("kind", "config"),
        [
            pytest.param("sgd", {"momentum": 0.9, "nesterov": True}, id="sgd"),
            pytest.param("adam", {}, id="adam"),
            pytest.param("adamw", {"weight_decay": 0.3}, id="adamw"),
            pytest.param("adagrad", {}, id="adagrad"),
            pytest.param("rmsprop", {"momentum": 0.5, "centered": True}, id="rmsprop"),
        ],
    )
    async def test_matches_keras(
        self, kind: str, config: dict[str, Any], replicas: int, dtype: type[np.floating[Any]]
    ) -> None:
        """Each element of the summed gradients is clipped to ``[-clipvalue, clipvalue]``."""
        await train_like_keras(kind, 0.05, {**config, "clipvalue": 0.5}, replicas, dtype)

    async def test_clips_the_sum_not_each_replica(self) -> None:
        """Two replicas' 0.4 and 0.4 sum to 0.8, clipped to 0.5; -0.3 and 0.2 are untouched."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.zeros(2), name="w")
        opt = SGD(1.0, clipvalue=0.5)
        grads = [[np.array([0.4, -0.3])], [np.array([0.4, 0.2])]]
        await train_step(strategy, opt, [w], grads)
        np.testing.assert_allclose(w.numpy(), [-0.5, 0.1], rtol=1e-12)

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            pytest.param(
                {"clipnorm": 1.0, "clipvalue": 0.5},
                "clipnorm=1.0 and clipvalue=0.5 were both given; pick one: clipnorm clips each "
                "gradient by its own norm, clipvalue each element to [-clipvalue, clipvalue]",
                id="clipnorm",
            ),
            pytest.param(
                {"clipvalue": 0.5, "global_clipnorm": 2.0},
                "clipvalue=0.5 and global_clipnorm=2.0 were both given; pick one: clipvalue "
                "clips each element to [-clipvalue, clipvalue], global_clipnorm all of them by "
                "their joint norm",
                id="global_clipnorm",
            ),
            pytest.param(
                {"clipnorm": 1, "clipvalue": 2, "global_clipnorm": 3},
                "clipnorm=1, clipvalue=2 and global_clipnorm=3 were all given; pick one",
                id="all-three",
            ),
        ],
    )
    @pytest.mark.parametrize("kind", list(CLASSES))
    def test_one_clipping_at_most(self, kind: str, kwargs: dict[str, Any], message: str) -> None:
        """As in Keras 3, at most one of ``clipnorm``, ``clipvalue``, ``global_clipnorm``."""
        with pytest.raises(ValueError, match=re.escape(message)):
            CLASSES[kind](**kwargs)

    @pytest.mark.parametrize(
        ("value", "error", "message"),
        [
            (-1.0, ValueError, "clipvalue must be >= 0 (0 or None: no clipping), got -1.0"),
            (math.nan, ValueError, "clipvalue must be finite, got nan"),
            ("1", TypeError, "clipvalue must be a number, got str '1'"),
        ],
    )
    def test_invalid(self, value: Any, error: type[Exception], message: str) -> None:
        """A ``clipvalue`` that is not a finite number ``>= 0`` is refused."""
        with pytest.raises(error, match=re.escape(message)):
            Adam(clipvalue=value)


# -- weight decay --------------------------------------------------------------------------


class TestWeightDecay:
    @pytest.mark.parametrize(("replicas", "dtype"), REPLICAS_AND_DTYPES)
    @pytest.mark.parametrize(
        ("kind", "learning_rate", "config"),
        [
            pytest.param("sgd", 0.1, {"weight_decay": 0.3}, id="sgd"),
            pytest.param(
                "sgd",
                halving,
                {"momentum": 0.8, "nesterov": True, "weight_decay": 0.5},
                id="nesterov",
            ),
            pytest.param("adam", 0.05, {"weight_decay": 0.2, "clipnorm": 1.0}, id="adam"),
            pytest.param("adagrad", halving, {"weight_decay": 0.4}, id="adagrad"),
            pytest.param(
                "rmsprop",
                0.02,
                {"weight_decay": 0.3, "momentum": 0.5, "global_clipnorm": 2.0},
                id="rmsprop",
            ),
        ],
    )
    async def test_matches_keras(
        self,
        kind: str,
        learning_rate: float | Callable[[int], float],
        config: dict[str, Any],
        replicas: int,
        dtype: type[np.floating[Any]],
    ) -> None:
        """Every optimizer decays each variable by that step's rate before its update."""
        await train_like_keras(kind, learning_rate, config, replicas, dtype)

    @pytest.mark.parametrize(("replicas", "dtype"), REPLICAS_AND_DTYPES)
    @pytest.mark.parametrize("kind", ["sgd", "adamw"])
    async def test_excluded_names_match_keras(
        self, kind: str, replicas: int, dtype: type[np.floating[Any]]
    ) -> None:
        """A variable whose name contains one of ``var_names`` is not decayed."""
        _, variables, _ = await train_like_keras(
            kind, 0.1, {"weight_decay": 0.5}, replicas, dtype, excluded=["bias", "sca"]
        )
        assert [v.name for v in variables] == ["dense/kernel", "dense/bias", "scale"]

    async def test_adamw_is_adam_with_weight_decay(self) -> None:
        """``AdamW(lr, wd)`` takes the very steps of ``Adam(lr, weight_decay=wd)``, bit for bit,
        and ``AdamW(lr, 0)`` those of ``Adam(lr)``."""
        rng = np.random.default_rng(11)
        strategy = MirroredStrategy(host_devices(2))
        pairs = [
            (AdamW(halving, 0.3), Adam(halving, weight_decay=0.3)),
            (AdamW(0.1, 0.0, amsgrad=True), Adam(0.1, amsgrad=True, weight_decay=0.0)),
        ]
        for adamw, adam in pairs:
            start = rng.normal(size=SHAPES["dense/kernel"]).astype(np.float32)
            with strategy.scope():
                a = Variable(start, name="a")
                b = Variable(start, name="b")
            for scale in SCALES:
                grads = random_grads(rng, 2, scale, np.float32)
                both = [[g[0], g[0]] for g in grads]
                await train_step(strategy, adamw, [a], [[g[0]] for g in both])
                await train_step(strategy, adam, [b], [[g[1]] for g in both])
            np.testing.assert_array_equal(a.numpy(), b.numpy())
            for slot in adam.slot_names:
                np.testing.assert_array_equal(
                    adamw.get_slot(a, slot).numpy(), adam.get_slot(b, slot).numpy()
                )

    async def test_exclude_by_variable_and_name(self) -> None:
        """``var_list`` and ``var_names`` together; a later call replaces an earlier one."""
        kernel = Variable(np.ones(2), name="dense/kernel")
        bias = Variable(np.ones(2), name="dense/bias")
        scale = Variable(np.ones(2), name="scale")
        variables = [kernel, bias, scale]
        opt = SGD(0.5, weight_decay=0.2)  # a decay multiplies by 1 - 0.2 * 0.5 = 0.9
        values = []
        for exclusions in (
            {"var_list": [scale], "var_names": ["bias"]},
            {"var_list": [kernel]},
            {},
        ):
            opt.exclude_from_weight_decay(**exclusions)
            await opt.apply_gradients([(np.zeros(2), v) for v in variables])
            values.append([float(v.numpy()[0].round(6)) for v in variables])
        assert values == [[0.9, 1.0, 1.0], [0.9, 0.9, 0.9], [0.81, 0.81, 0.81]]

    async def test_bad_exclusions_change_nothing(self) -> None:
        """A refused ``exclude_from_weight_decay`` keeps the exclusions as they were."""
        kernel = Variable(np.ones(2), name="dense/kernel")
        bias = Variable(np.ones(2), name="dense/bias")
        opt = SGD(0.5, weight_decay=0.2)
        opt.exclude_from_weight_decay(var_names=["bias"])
        refused = []
        for kwargs in (
            {"var_list": [kernel, np.ones(2)]},
            {"var_names": "kernel"},
            {"var_names": ["kernel", 3]},
        ):
            with pytest.raises(TypeError) as info:
                opt.exclude_from_weight_decay(**kwargs)
            refused.append(str(info.value))
        assert refused == [
            "expected an aioreplica.Variable, got ndarray; create model parameters with "
            "aioreplica.Variable(...) (inside strategy.scope())",
            "exclude_from_weight_decay(): var_names must be a list of strings, got the string "
            "'kernel'; pass ['kernel'] to exclude the variables whose names contain it",
            "exclude_from_weight_decay(): var_names must hold strings, got int 3",
        ]
        await opt.apply_gradients([(np.zeros(2), kernel), (np.zeros(2), bias)])
        assert (kernel.numpy().tolist(), bias.numpy().tolist()) == ([0.9, 0.9], [1.0, 1.0])

    async def test_no_weight_decay_ignores_exclusions(self) -> None:
        """Without ``weight_decay`` nothing decays; exclusions are accepted and change nothing."""
        w = Variable(np.ones(2), name="w")
        opt = SGD(0.5)
        opt.exclude_from_weight_decay(var_names=["w"])
        await opt.apply_gradients([(np.ones(2), w)])
        assert w.numpy().tolist() == [0.5, 0.5]

    @pytest.mark.parametrize(
        ("value", "error", "message"),
        [
            (-0.1, ValueError, "weight_decay must be >= 0 (0: no decay), got -0.1"),
            (math.inf, ValueError, "weight_decay must be finite, got inf"),
            ("0.1", TypeError, "weight_decay must be a number, got str '0.1'"),
        ],
    )
    @pytest.mark.parametrize("kind", list(CLASSES))
    def test_invalid(self, kind: str, value: Any, error: type[Exception], message: str) -> None:
        """A ``weight_decay`` that is not a finite number ``>= 0`` is refused."""
        with pytest.raises(error, match=re.escape(message)):
            CLASSES[kind](0.1, weight_decay=value)


# -- learning rates that are 0-d arrays ----------------------------------------------------


class TestArrayLearningRate:
    @pytest.mark.parametrize(
        "learning_rate",
        [
            pytest.param(lambda step: np.where(step < 2, 0.1, 0.01), id="np.where"),
            pytest.param(lambda step: np.asarray(0.1 if step < 2 else 0.01), id="asarray"),
            pytest.param(
                lambda step: np.float32(0.1 if step < 2 else 0.01) * np.ones((), np.float32),
                id="float32",
            ),
            pytest.param(lambda step: np.float64(0.1 if step < 2 else 0.01), id="numpy-scalar"),
        ],
    )
    async def test_schedule_returning_a_0d_array(self, learning_rate: Callable[[int], Any]) -> None:
        """A schedule's 0-d real array is the number it holds, step by step."""
        w = Variable(np.zeros(1), name="w")
        opt = SGD(learning_rate)
        rates = []
        for _ in range(3):
            rates.append(opt.current_learning_rate())
            await opt.apply_gradients([(np.ones(1), w)])
        assert [round(rate, 6) for rate in rates] == [0.1, 0.1, 0.01]
        assert all(type(rate) is float for rate in rates)
        np.testing.assert_allclose(w.numpy(), [-0.21], rtol=1e-6)

    async def test_callable_and_number(self) -> None:
        """A callable of no arguments may return one too, and a 0-d array is a number."""
        w = Variable(np.zeros(1), name="w")
        await SGD(lambda: np.array(0.5)).apply_gradients([(np.ones(1), w)])
        opt = SGD(np.array(0.25))  # type: ignore[arg-type]
        await opt.apply_gradients([(np.ones(1), w)])
        assert (w.numpy().tolist(), opt.learning_rate, type(opt.learning_rate)) == (
            [-0.75],
            0.25,
            float,
        )

    @pytest.mark.parametrize(
        ("returned", "error", "message"),
        [
            pytest.param(
                np.array([0.1]),
                TypeError,
                "learning_rate(1) must be a number, got ndarray array([0.1])",
                id="shape-1",
            ),
            pytest.param(
                np.array(0.1 + 0j),
                TypeError,
                "learning_rate(1) must be a number, got ndarray array(0.1+0.j)",
                id="complex",
            ),
            pytest.param(
                np.array(True),
                TypeError,
                "learning_rate(1) must be a number, got ndarray array(True)",
                id="bool",
            ),
            pytest.param(
                np.array(np.nan),
                ValueError,
                "learning_rate(1) must be finite, got array(nan)",
                id="nan",
            ),
        ],
    )
    async def test_other_arrays_change_nothing(
        self, returned: Array, error: type[Exception], message: str
    ) -> None:
        """Other shapes, non-real and non-finite values are refused; the step changes nothing."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(2), name="w")
        opt = Adam(lambda step: 0.1 if step == 0 else returned, amsgrad=True, weight_decay=0.1)
        await train_step(strategy, opt, [w], [[np.ones(2)], [np.ones(2)]])
        before = [np.array(copy) for v in [w, *opt.variables()] for copy in v.values]
        with pytest.raises(error, match=re.escape(message)):
            await train_step(strategy, opt, [w], [[np.ones(2)], [np.ones(2)]])
        after = [np.array(copy) for v in [w, *opt.variables()] for copy in v.values]
        assert opt.iterations == 1
        for old, new in zip(before, after, strict=True):
            np.testing.assert_array_equal(new, old)


# -- all or nothing ------------------------------------------------------------------------


class DeviceLost(Exception):
    pass


class FailingDevice(FakeDevice):
    """A host-backed device whose next job touching ``target``'s copy raises, once armed."""

    def __init__(self, index: int) -> None:
        super().__init__(f"cpu:{index}", index)
        self.target: Variable | None = None

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        target = self.target
        if target is not None and any(arg is copy for arg in args for copy in target.values):
            raise DeviceLost(f"{self.name} lost during the update")
        return await super().run(fn, *args, **kwargs)


class TestAllOrNothing:
    @pytest.mark.parametrize(
        "config",
        [
            pytest.param({"amsgrad": True}, id="amsgrad"),
            pytest.param({"clipvalue": 0.5}, id="clipvalue"),
            pytest.param({"weight_decay": 0.3}, id="weight_decay"),
            pytest.param({"amsgrad": True, "weight_decay": 0.3, "clipvalue": 0.5}, id="all"),
        ],
    )
    async def test_failed_update_changes_nothing(self, config: dict[str, Any]) -> None:
        """A device failing in a variable's update: no variable, slot or count moved,
        and the next step carries on from the state before, as Keras would compute it."""
        devices = [FailingDevice(0), FailingDevice(1)]
        strategy = MirroredStrategy(devices)
        rng = np.random.default_rng(5)
        variables = make_variables(strategy, rng, np.float64)
        opt = Adam(0.05, **config)
        ref = Keras3("adam", 0.05, **config).tracking(variables)
        grads = random_grads(rng, 2, 2.0, np.float64)
        await train_step(strategy, opt, variables, grads)
        ref.apply(summed(grads))
        before = [np.array(c) for v in [*variables, *opt.variables()] for c in v.values]
        for device in devices:
            device.target = variables[0]
        with pytest.raises(DeviceLost, match="lost during the update"):
            await train_step(strategy, opt, variables, random_grads(rng, 2, 2.0, np.float64))
        after = [np.array(c) for v in [*variables, *opt.variables()] for c in v.values]
        assert opt.iterations == 1
        for old, new in zip(before, after, strict=True):
            np.testing.assert_array_equal(new, old)
        for device in devices:
            device.target = None
        grads = random_grads(rng, 2, 0.1, np.float64)
        await train_step(strategy, opt, variables, grads)
        ref.apply(summed(grads))
        assert_matches(opt, variables, ref, np.float64)


# -- config --------------------------------------------------------------------------------


class TestConfig:
    def test_get_config_has_the_new_arguments(self) -> None:
        """Every optimizer's config holds ``weight_decay``, ``clipvalue`` (and Adam's
        ``amsgrad``), in Keras' order, and rebuilds the same optimizer."""
        optimizers: list[Optimizer] = [
            SGD(0.1, weight_decay=0.01, clipvalue=0.5),
            Adam(0.2, amsgrad=True, weight_decay=0.1, clipvalue=1),
            AdamW(0.1, 0.02, amsgrad=True, clipvalue=2.0),
            Adagrad(0.1, weight_decay=0.3, clipnorm=1.0),
            RMSprop(0.1, weight_decay=0.0, global_clipnorm=1.0),
        ]
        for opt in optimizers:
            config = opt.get_config()
            assert "weight_decay" in config
            assert list(config)[-3:] == ["clipnorm", "global_clipnorm", "clipvalue"]
            rebuilt = type(opt)(**config)
            assert (rebuilt.get_config(), repr(rebuilt)) == (config, repr(opt))
            assert rebuilt.slot_names == opt.slot_names
        assert optimizers[0].get_config() == {
            "learning_rate": 0.1,
            "momentum": 0.0,
            "nesterov": False,
            "weight_decay": 0.01,
            "clipnorm": None,
            "global_clipnorm": None,
            "clipvalue": 0.5,
        }
        assert optimizers[2].get_config() == {
            "learning_rate": 0.1,
            "weight_decay": 0.02,
            "beta_1": 0.9,
            "beta_2": 0.999,
            "epsilon": 1e-7,
            "amsgrad": True,
            "clipnorm": None,
            "global_clipnorm": None,
            "clipvalue": 2.0,
        }
        assert repr(optimizers[1]) == (
            "Adam(learning_rate=0.2, beta_1=0.9, beta_2=0.999, epsilon=1e-07, amsgrad=True, "
            "weight_decay=0.1, clipvalue=1.0)"
        )

    def test_from_config_rebuilds_each_optimizer(self) -> None:
        """Keras' ``from_config``: the class rebuilds an optimizer of the same settings from
        its config (a schedule included); an argument the class does not take
        is refused."""

        def schedule(step: int) -> float:
            return 0.1 / (1 + step)

        for opt in [SGD(0.1, momentum=0.9, nesterov=True), Adam(schedule, amsgrad=True)]:
            rebuilt = type(opt).from_config(opt.get_config())
            assert (type(rebuilt), rebuilt.get_config()) == (type(opt), opt.get_config())
        with pytest.raises(TypeError, match="amsgrad"):
            SGD.from_config({"learning_rate": 0.1, "amsgrad": True})
