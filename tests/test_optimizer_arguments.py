"""Optimizers refusing what they cannot keep: copies and pickles, lists that are no lists,
variables of another strategy (built, or restored), and bool gradients; each refusal changes
nothing. A hyperparameter held in another strategy's variable is read, as a number is."""

from __future__ import annotations

import copy
import pickle
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from aioreplica import Checkpoint, CheckpointError, MirroredStrategy, PerReplica, Variable
from aioreplica.optimizers import SGD, Adam, Optimizer
from aioreplica.testing import host_devices

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

pytestmark = pytest.mark.anyio

#: The repr of the second strategy of these tests, over other devices than the first's.
OTHER = "MirroredStrategy(devices=['cpu:2', 'cpu:3'])"
#: The repr of the first.
MINE = "MirroredStrategy(devices=['cpu:0', 'cpu:1'])"


def state(opt: Optimizer, variables: Sequence[Variable]) -> tuple[Any, ...]:
    """Every copy of every variable and slot (as lists), the slots' names and the step."""
    slots = opt.variables()
    return (
        [[np.array(copy).tolist() for copy in v.values] for v in [*variables, *slots]],
        [slot.name for slot in slots],
        opt.iterations,
    )


async def step_ones(strategy: MirroredStrategy, opt: Optimizer, *variables: Variable) -> None:
    """One step of ``opt`` in which every replica passes a gradient of ones per variable."""

    async def step() -> None:
        await opt.apply_gradients([(np.ones(v.shape), v) for v in variables])

    await strategy.run(step)


def two_strategies() -> tuple[MirroredStrategy, MirroredStrategy]:
    return MirroredStrategy(host_devices(2)), MirroredStrategy(["cpu:2", "cpu:3"])


class TestCopying:
    @pytest.mark.parametrize(
        "duplicate",
        [copy.copy, copy.deepcopy, pickle.dumps],
        ids=["copy", "deepcopy", "pickle"],
    )
    async def test_is_refused_saying_how_to_make_a_fresh_one(
        self, duplicate: Callable[[Any], Any]
    ) -> None:
        """A copy, deep copy or pickle of an optimizer is a TypeError naming it, how to make a
        fresh one and where its state is kept; the optimizer steps on as before."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(2), name="w")
            opt = SGD(0.1, momentum=0.9)
        await step_ones(strategy, opt, w)
        before = state(opt, [w])
        with pytest.raises(TypeError) as info:
            duplicate(opt)
        assert str(info.value) == (
            "cannot copy or pickle SGD(learning_rate=0.1, momentum=0.9, nesterov=False): its "
            "slots are variables of its strategy and its steps take their turns with theirs, "
            "so a copy would share some of its state and not the rest; make a fresh optimizer "
            "with the same hyperparameters with type(opt).from_config(opt.get_config()) (no "
            "slots, no steps yet), and keep an optimizer's step count and slots in an "
            "aioreplica.Checkpoint (restore it into the fresh one)"
        )
        assert state(opt, [w]) == before
        await step_ones(strategy, opt, w)
        assert opt.iterations == 2

    async def test_the_way_the_message_gives_keeps_the_state(self, tmp_path: Path) -> None:
        """``from_config`` makes a fresh optimizer, and a checkpoint restored into it gives it
        the step count and slots of the first."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(2), name="w")
            opt = Adam(0.1)
        await step_ones(strategy, opt, w)
        path = await Checkpoint(w=w, opt=opt).save(tmp_path / "opt.npz")
        with strategy.scope():
            fresh = type(opt).from_config(opt.get_config())
        await Checkpoint(w=w, opt=fresh).restore(path)
        assert state(fresh, [w]) == state(opt, [w])


class TestVariableLists:
    @pytest.mark.parametrize("method", ["build", "exclude_from_weight_decay"])
    async def test_a_single_variable_is_refused(self, method: str) -> None:
        """A variable given where a list of them is expected is a TypeError saying so (not
        one about its elements); nothing is built or excluded."""
        w = Variable(np.ones(3), name="w")
        opt = SGD(0.5, momentum=0.9, weight_decay=0.2)
        with pytest.raises(TypeError) as info:
            getattr(opt, method)(w)
        assert str(info.value) == (
            f"{method}(): var_list must be a list of variables, got the single variable 'w' "
            "(whose elements it would go through); pass a list holding it, as in "
            f"opt.{method}([variable])"
        )
        assert opt.variables == []
        await opt.apply_gradients([(np.zeros(3), w)])  # decayed: 1 - 1 * 0.2 * 0.5
        assert w.numpy().tolist() == [0.9] * 3

    @pytest.mark.parametrize(
        ("method", "value", "shown"),
        [("build", None, "NoneType None"), ("exclude_from_weight_decay", 3, "int 3")],
    )
    def test_a_value_that_is_no_list_is_refused(self, method: str, value: Any, shown: str) -> None:
        """``var_list`` that is not iterable is a TypeError naming the parameter and the
        value, not Python's "object is not iterable"."""
        opt = SGD(0.1, momentum=0.9, weight_decay=0.1)
        with pytest.raises(TypeError) as info:
            getattr(opt, method)(value)
        assert str(info.value) == (
            f"{method}(): var_list must be a list of aioreplica.Variable objects, got {shown}"
        )

    async def test_var_names_that_are_no_list_are_refused(self) -> None:
        """``var_names`` that is not iterable is a TypeError naming it; what was excluded
        before stays excluded."""
        b = Variable(np.ones(1), name="dense/bias")
        opt = SGD(0.5, weight_decay=0.2)
        opt.exclude_from_weight_decay(var_names=["bias"])
        with pytest.raises(TypeError) as info:
            opt.exclude_from_weight_decay(var_names=3)  # type: ignore[arg-type]
        assert str(info.value) == (
            "exclude_from_weight_decay(): var_names must be a list of strings, got int 3"
        )
        await opt.apply_gradients([(np.zeros(1), b)])
        assert b.numpy().tolist() == [1.0]


class TestOtherStrategies:
    def test_build_refuses_a_variable_of_another_strategy(self) -> None:
        """``build`` of an optimizer of one strategy refuses a variable of another, naming
        both, and makes no slot, for it or for the variables listed with it."""
        mine, other = two_strategies()
        with mine.scope():
            w = Variable(np.ones(3), name="w")
            opt = SGD(0.1, momentum=0.9)
        with other.scope():
            u = Variable(np.ones(3), name="u")
        with pytest.raises(ValueError, match=r"^build\(\): variable 'u' belongs to") as info:
            opt.build([w, u])
        assert str(info.value) == (
            f"build(): variable 'u' belongs to {OTHER}, but this SGD belongs to {MINE} (it was "
            "created in its scope), whose steps would refuse it; nothing was built: use an "
            "optimizer only with its own strategy's variables, and create one optimizer per "
            "strategy, inside `with strategy.scope():`"
        )
        assert opt.variables == []

    def test_build_refuses_a_variable_made_outside_any_scope(self) -> None:
        """An optimizer of a strategy refuses to build slots for a variable made outside any
        scope, which its steps would refuse to train."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            opt = SGD(0.1, momentum=0.9)
        plain = Variable(np.ones(3), name="plain")
        with pytest.raises(ValueError, match=r"^build\(\): variable 'plain' was created") as info:
            opt.build([plain])
        assert str(info.value) == (
            f"build(): variable 'plain' was created outside any strategy scope, but this SGD "
            f"belongs to {MINE} (it was created in its scope), whose steps would refuse it; "
            "nothing was built: create model variables inside `with strategy.scope():`"
        )
        assert opt.variables == []

    def test_an_optimizer_of_no_strategy_yet_builds_any_variable(self) -> None:
        """An optimizer made outside any scope belongs to no strategy until its first step,
        so ``build`` takes a variable of any strategy, as before."""
        _, other = two_strategies()
        with other.scope():
            u = Variable(np.ones(3), name="u")
        opt = SGD(0.1, momentum=0.9)
        opt.build([u])
        assert [slot.name for slot in opt.variables] == ["u/momentum"]

    @pytest.mark.parametrize("partial", [False, True])
    async def test_a_restore_refuses_slots_for_a_variable_of_another_strategy(
        self, tmp_path: Path, *, partial: bool
    ) -> None:
        """A restore into an optimizer of one strategy refuses to make slots for a variable
        of another, as ``build`` refuses it, naming the variable and both strategies; nothing
        is restored, the variable included."""
        mine, other = two_strategies()
        with other.scope():
            u = Variable(np.ones(2), name="u")
            theirs = SGD(0.1, momentum=0.9)
        await step_ones(other, theirs, u)
        path = await Checkpoint(opt=theirs, u=u).save(tmp_path / "other.npz")
        await u.assign(np.full(2, 5.0))
        with mine.scope():
            opt = SGD(0.1, momentum=0.9)
        with pytest.raises(CheckpointError) as info:
            await Checkpoint(opt=opt, u=u).restore(path, partial=partial)
        assert info.value.problems == (
            f"opt/slots/u: Checkpoint.restore(): variable 'u' belongs to {OTHER}, but this SGD "
            f"belongs to {MINE} (it was created in its scope), whose steps would refuse it; "
            "nothing was restored: use an optimizer only with its own strategy's variables, "
            "and create one optimizer per strategy, inside `with strategy.scope():`",
        )
        assert (opt.variables, opt.iterations, u.numpy().tolist()) == ([], 0, [5.0, 5.0])

    @pytest.mark.parametrize("form", ["given", "set", "callable", "momentum"])
    async def test_a_hyperparameter_variable_of_another_strategy_is_read(self, form: str) -> None:
        """A hyperparameter held in a 0-d variable of another strategy is read where any
        number is, in the step's merge (its cross-replica value): an optimizer of one
        strategy takes it, given, set or returned by a callable, and steps with it."""
        mine, other = two_strategies()
        with other.scope():
            held = Variable(0.25, name="held")
        with mine.scope():
            w = Variable(np.ones(2), name="w")
            opt = SGD(0.1)
            if form == "given":
                opt = SGD(held)
            elif form == "set":
                opt.learning_rate = held
            elif form == "callable":
                opt = SGD(lambda: held)
            else:
                opt = SGD(0.25, momentum=held)
        values = []
        for _ in range(2):  # the summed gradient of the two replicas is 2
            await step_ones(mine, opt, w)
            values.append(w.numpy().tolist())
        assert values == (
            [[0.5, 0.5], [-0.125, -0.125]] if form == "momentum" else [[0.5, 0.5], [0.0, 0.0]]
        )

    async def test_an_optimizer_of_the_default_strategy_reads_another_strategys_variable(
        self,
    ) -> None:
        """An optimizer stepping outside any ``strategy.run()`` (the default strategy) reads
        its learning rate from a strategy's 0-d variable too."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            held = Variable(0.25, name="held")
        w = Variable(np.ones(2), name="w")
        opt = SGD(held)
        await opt.apply_gradients([(np.ones(2), w)])
        assert w.numpy().tolist() == [0.75, 0.75]

    def test_a_variable_made_outside_any_scope_is_read_anywhere(self) -> None:
        """A hyperparameter variable made outside any scope belongs to no strategy, so an
        optimizer of any strategy takes it."""
        held = Variable(0.5, name="held")
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            opt = SGD(held, momentum=held)
        assert opt.get_config()["learning_rate"] is held


class TestGradientDtypes:
    @pytest.mark.parametrize("given", [np.array([True, False]), [True, False]])
    async def test_a_bool_gradient_is_refused(self, given: Any) -> None:
        """A bool gradient is a TypeError naming the variable and the replica (its True and
        False would be summed as numbers); nothing changes."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(2, np.float32), name="w")
        opt = SGD(0.5, momentum=0.5)

        async def step(grad: Any) -> None:
            await opt.apply_gradients([(grad, w)])

        before = state(opt, [w])
        with pytest.raises(TypeError) as info:
            await strategy.run(step, args=(PerReplica([np.ones(2), given]),))
        assert str(info.value) == (
            "apply_gradients(): the gradient of variable 'w' from replica 1 has dtype bool, "
            "which is no gradient: its True and False would be summed across replicas as 1 "
            "and 0; pass a gradient of a float dtype"
        )
        assert state(opt, [w]) == before

    async def test_an_integer_gradient_is_cast_to_the_variables_dtype(self) -> None:
        """An integer gradient is cast to its float variable's dtype, as Keras casts it."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.ones(2, np.float32), name="w")
        opt = SGD(0.25)

        async def step() -> None:
            await opt.apply_gradients([(np.array([1, 2]), w)])

        await strategy.run(step)
        assert [np.array(copy).tolist() for copy in w.values] == [[0.5, 0.0]] * 2
