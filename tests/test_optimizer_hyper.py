"""Optimizer hyperparameters held in 0-d variables: read at the start of every step, checked
then, kept by ``get_config``, refused with a clear error when they cannot hold a number."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from aioreplica import Checkpoint, MirroredStrategy, Variable
from aioreplica.optimizers import SGD, Adagrad, Adam, AdamW, Optimizer, RMSprop
from aioreplica.testing import host_devices

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio


async def step_ones(strategy: MirroredStrategy, opt: Optimizer, *variables: Variable) -> None:
    """One step of ``opt`` in which every replica passes a gradient of ones for each of
    ``variables`` (summed over two replicas: twos)."""

    async def step() -> None:
        await opt.apply_gradients([(np.ones(v.shape), v) for v in variables])

    await strategy.run(step)


def values(v: Variable) -> list[list[float]]:
    return [np.asarray(copy).tolist() for copy in v.values]


class TestLearningRateVariable:
    @pytest.mark.parametrize("form", ["variable", "callable", "schedule"])
    async def test_is_read_at_every_step(self, form: str) -> None:
        """A learning rate held in a 0-d variable (given itself, or returned by a callable or
        a schedule) is read at the start of every step, so assigning it between steps (as
        between epochs) changes the next step's rate."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            lr = Variable(0.1, name="lr")
            w = Variable(np.ones(2), name="w")
        given: Any = {"variable": lr, "callable": lambda: lr, "schedule": lambda step: lr}[form]
        opt = SGD(given)
        assert opt.learning_rate is given
        await step_ones(strategy, opt, w)  # 1 - 0.1 * 2
        await lr.assign(0.5)
        await step_ones(strategy, opt, w)  # 0.8 - 0.5 * 2
        assert values(w) == [[0.8 - 1.0] * 2] * 2
        assert opt.current_learning_rate() == 0.5

    async def test_is_kept_by_get_config(self) -> None:
        """``get_config`` holds the variable itself, so ``from_config`` makes an optimizer
        that reads the same variable."""
        lr = Variable(0.25, name="lr")
        opt = SGD(lr, momentum=0.5)
        config = opt.get_config()
        assert config["learning_rate"] is lr
        w = Variable(np.ones(1), name="w")
        again = SGD.from_config(config)
        await again.apply_gradients([(np.ones(1), w)])
        assert w.numpy().tolist() == [0.75]

    @pytest.mark.parametrize(
        ("value", "shown"),
        [
            (np.zeros(2), "of shape (2,) and dtype float64"),
            (True, "of shape () and dtype bool"),
            (np.complex128(1j), "of shape () and dtype complex128"),
        ],
    )
    def test_one_that_cannot_hold_a_rate_is_refused(self, value: Any, shown: str) -> None:
        """A variable that is not 0-d, or holds no real number, is refused at construction,
        saying what works."""
        lr = Variable(value, name="lr")
        with pytest.raises(
            TypeError,
            match=re.escape(
                f"learning_rate must be a number, got Variable 'lr' {shown}; pass a number, or "
                "a 0-d aioreplica.Variable holding one (read at the start of every step): an "
                "integer or float variable of shape ()"
            ),
        ):
            SGD(lr)

    async def test_a_callable_returning_a_bad_variable_is_refused_at_the_step(self) -> None:
        """A callable that returns a variable of another shape fails the step that calls it;
        nothing changes."""
        rates = Variable(np.full(2, 0.1), name="rates")
        w = Variable(np.ones(1), name="w")
        opt = SGD(lambda: rates)
        with pytest.raises(TypeError, match=re.escape("learning_rate() must be a number, got")):
            await opt.apply_gradients([(np.ones(1), w)])
        assert (w.numpy().tolist(), opt.iterations) == ([1.0], 0)

    @pytest.mark.parametrize(
        ("bad", "message"),
        [
            (
                "fast",
                "learning_rate must be a number, got str 'fast'; pass a number, or a 0-d "
                "aioreplica.Variable holding one (read at the start of every step); or a "
                "callable of no arguments, or a schedule called with the step count, "
                "learning_rate(step), each returning either",
            ),
            (None, "learning_rate must be a number, got NoneType None; pass a number, or"),
        ],
    )
    def test_other_values_are_refused_naming_the_forms_that_work(
        self, bad: Any, message: str
    ) -> None:
        """A learning rate of no accepted form is refused with the forms that work."""
        with pytest.raises(TypeError, match=re.escape(message)):
            SGD(bad)


#: (optimizer class, hyperparameter, a good value, a value its check refuses)
HYPERPARAMETERS = [
    (SGD, "momentum", 0.5, 1.5),
    (SGD, "weight_decay", 0.1, -1.0),
    (SGD, "clipnorm", 0.5, -0.5),
    (SGD, "clipvalue", 0.5, -1.0),
    (SGD, "global_clipnorm", 0.5, -1.0),
    (Adam, "beta_1", 0.5, 1.0),
    (Adam, "beta_2", 0.5, 1.0),
    (Adam, "epsilon", 0.1, 0.0),
    (AdamW, "weight_decay", 0.1, -0.5),
    (Adagrad, "initial_accumulator_value", 0.5, -1.0),
    (Adagrad, "epsilon", 0.1, 0.0),
    (RMSprop, "rho", 0.5, 2.0),
    (RMSprop, "momentum", 0.5, 2.0),
    (RMSprop, "epsilon", 0.1, -1.0),
]


class TestOtherHyperparameters:
    @pytest.mark.parametrize(("cls", "name", "good", "bad"), HYPERPARAMETERS)
    async def test_a_variable_trains_as_its_number(
        self, cls: type[Optimizer], name: str, good: float, bad: float
    ) -> None:
        """Every float hyperparameter takes a 0-d variable, which trains as its number and
        which ``get_config`` keeps; a value assigned to it that the constructor would refuse
        fails the next step, naming it, and changes nothing."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            held = Variable(good, name="held")
            w = Variable(np.full(3, 2.0), name="w")
            plain_w = Variable(np.full(3, 2.0), name="plain_w")
        opt = cls(0.1, **{name: held})
        plain = cls(0.1, **{name: good})
        assert opt.get_config()[name] is held
        for _ in range(2):
            await step_ones(strategy, opt, w)
            await step_ones(strategy, plain, plain_w)
        assert values(w) == values(plain_w)
        await held.assign(bad)
        with pytest.raises(ValueError, match=re.escape(f"{name} (variable 'held') must be")):
            await step_ones(strategy, opt, w)
        assert (values(w), opt.iterations) == (values(plain_w), 2)

    async def test_momentum_is_read_at_every_step(self) -> None:
        """A momentum held in a variable keeps its slot even while it is 0, and each step
        uses its value then."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            momentum = Variable(0.0, name="momentum")
            w = Variable(np.ones(1), name="w")
        opt = SGD(0.1, momentum=momentum)
        assert opt.slot_names == ("momentum",)
        await step_ones(strategy, opt, w)  # m = -0.2, w = 0.8
        await momentum.assign(0.9)
        await step_ones(strategy, opt, w)  # m = 0.9 * -0.2 - 0.2, w = 0.8 - 0.38
        assert np.allclose(values(w), [[0.42]] * 2)
        assert np.allclose(values(opt.get_slot(w, "momentum")), [[-0.38]] * 2)

    @pytest.mark.parametrize(
        ("cls", "name"), [(Adam, "beta_1"), (RMSprop, "rho"), (AdamW, "weight_decay")]
    )
    def test_one_of_another_shape_is_refused(self, cls: type[Optimizer], name: str) -> None:
        """A variable of another shape is refused at construction, naming the hyperparameter
        and saying what works."""
        held = Variable(np.zeros(3), name="held")
        with pytest.raises(
            TypeError,
            match=re.escape(
                f"{name} must be a number, got Variable 'held' of shape (3,) and dtype float64; "
                "pass a number, or a 0-d aioreplica.Variable holding one"
            ),
        ):
            cls(**{name: held})

    def test_other_values_are_refused_naming_the_forms_that_work(self) -> None:
        """A hyperparameter of no accepted form is refused with the forms that work."""
        with pytest.raises(
            TypeError,
            match=re.escape(
                "beta_1 must be a number, got str 'x'; pass a number, or a 0-d "
                "aioreplica.Variable holding one (read at the start of every step)"
            ),
        ):
            Adam(beta_1="x")  # type: ignore[arg-type]


class TestCheckpoints:
    async def test_an_optimizer_with_variables_round_trips(self, tmp_path: Path) -> None:
        """An optimizer whose hyperparameters are variables saves and restores its step count
        and slots; the variables themselves are saved where the program lists them."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            lr = Variable(0.1, name="lr")
            momentum = Variable(0.5, name="momentum")
            w = Variable(np.ones(2), name="w")
        opt = SGD(lambda: lr, momentum=momentum)
        await step_ones(strategy, opt, w)
        checkpoint = Checkpoint(w=w, opt=opt, lr=lr, momentum=momentum)
        path = await checkpoint.save(tmp_path / "ckpt")
        saved = (values(w), values(opt.get_slot(w, "momentum")))
        await lr.assign(0.5)
        await momentum.assign(0.0)
        await step_ones(strategy, opt, w)
        await checkpoint.restore(path)
        assert (values(w), values(opt.get_slot(w, "momentum"))) == saved
        assert (opt.iterations, lr.numpy().item(), momentum.numpy().item()) == (1, 0.1, 0.5)
        assert opt.get_config()["momentum"] is momentum

    async def test_a_learning_rate_variable_stays_the_optimizers_after_a_restore(
        self, tmp_path: Path
    ) -> None:
        """A variable given as the learning rate is the program's to save, as a callable is:
        the optimizer's entry holds no number for it, and a restore leaves the optimizer
        reading the variable (restored where the program lists it)."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            lr = Variable(0.1, name="lr")
            w = Variable(np.ones(2), name="w")
        opt = SGD(lr)
        await step_ones(strategy, opt, w)
        checkpoint = Checkpoint(w=w, opt=opt, lr=lr)
        path = await checkpoint.save(tmp_path / "ckpt")
        await lr.assign(0.5)
        await checkpoint.restore(path)
        assert opt.learning_rate is lr
        assert lr.numpy().item() == 0.1
        await lr.assign(0.25)
        before = values(w)
        await step_ones(strategy, opt, w)
        assert values(w) == [[x - 0.25 * 2 for x in copy] for copy in before]


class TestSlotsMadeOutsideAStep:
    async def test_build_starts_adagrads_accumulator_at_the_variables_value_now(self) -> None:
        """An Adagrad ``initial_accumulator_value`` held in a variable: slots made by
        ``build()`` start at the variable's value when they are made, as a step's do, before
        and after steps."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            initial = Variable(0.1, name="initial")
            w, stepped, later = (Variable(np.ones(2), name=name) for name in ("w", "s", "l"))
        opt = Adagrad(0.1, initial_accumulator_value=initial)
        await initial.assign(1.0)
        opt.build([w])
        await step_ones(strategy, Adagrad(0.1, initial_accumulator_value=initial), stepped)
        await step_ones(strategy, opt, stepped)
        await initial.assign(5.0)
        opt.build([later])
        assert [values(opt.get_slot(v, "accumulator")) for v in (w, later)] == [
            [[1.0, 1.0]] * 2,
            [[5.0, 5.0]] * 2,
        ]

    async def test_a_restore_resets_adagrads_accumulator_to_the_variables_value_now(
        self, tmp_path: Path
    ) -> None:
        """A restore of a file saved before any step resets the accumulator to the held
        initial value as the variable holds it at the restore."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            initial = Variable(0.1, name="initial")
            w = Variable(np.ones(2), name="w")
        opt = Adagrad(0.1, initial_accumulator_value=initial)
        path = await Checkpoint(w=w, opt=opt).save(tmp_path / "ckpt")
        await initial.assign(1.0)
        await step_ones(strategy, opt, w)
        await initial.assign(3.0)
        await Checkpoint(w=w, opt=opt).restore(path)
        assert values(opt.get_slot(w, "accumulator")) == [[3.0, 3.0]] * 2

    async def test_build_refuses_a_held_value_that_the_constructor_would(self) -> None:
        """A held initial value that became negative fails ``build()``, naming the variable,
        and no slot is made."""
        initial = Variable(0.1, name="initial")
        w = Variable(np.ones(2), name="w")
        opt = Adagrad(0.1, initial_accumulator_value=initial)
        await initial.assign(-1.0)
        with pytest.raises(
            ValueError,
            match=re.escape("initial_accumulator_value (variable 'initial') must be >= 0"),
        ):
            opt.build([w])
        assert opt.variables() == []


async def test_a_refused_step_leaves_the_optimizer_as_it_was() -> None:
    """A step refused for a held value (here the second one read) leaves every attribute of
    the optimizer as it was, the values read before the refused one included."""
    beta_1 = Variable(0.9, name="beta_1")
    epsilon = Variable(1e-7, name="epsilon")
    w = Variable(np.ones(2), name="w")
    opt = Adam(0.1, beta_1=beta_1, epsilon=epsilon)
    before = dict(vars(opt))
    await beta_1.assign(0.5)
    await epsilon.assign(-1.0)
    with pytest.raises(ValueError, match=re.escape("epsilon (variable 'epsilon') must be > 0")):
        await opt.apply_gradients([(np.ones(2), w)])
    assert [key for key, value in vars(opt).items() if value is not before[key]] == []
    assert (opt.iterations, w.numpy().tolist()) == (0, [1.0, 1.0])
