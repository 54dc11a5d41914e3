"""Optimizers: one merge round per step, one packed all-reduce, an all-or-nothing update.

``await opt.apply_gradients(grads_and_vars)`` is called by every replica with its own
gradients. In the merge round, the gradients of every variable are summed across replicas in
one packed all-reduce on the strategy's reduction engine (small ones packed together, as TF
does: users scale their loss by the global batch size), then each variable's new value and
new slot values (momentum, moments) are computed copy by copy, and all of them, with the step
count, are committed at once. If anything fails or the caller is cancelled before that, no
variable, slot or counter has changed.

Gradient clipping (``clipnorm``, ``clipvalue``, ``global_clipnorm``) works on the summed
gradients inside that merge round, on each copy's device, so every replica clips alike at no
extra round. Weight decay (``weight_decay``) is decoupled, as Keras' base class applies it:
each copy of a variable first shrinks by ``weight_decay`` times the step's learning rate, then
takes the update; the decay is no gradient, so it is neither summed nor clipped.

The update rules follow Keras' ``SGD``, ``Adam``, ``AdamW``, ``Adagrad`` and ``RMSprop``
exactly, so the same hyperparameters train the same way.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import TYPE_CHECKING, Any, ClassVar, Final, NoReturn, Self, TypeVar, final

import numpy as np

from ._collectives import reductions_for
from ._context import MERGE_CALLS, context_state, default_replica_context, get_replica_context
from ._errors import ReplicaSyncError, WorkersDisagree, add_note, checked_integer, replica_list
from ._options import ReduceOp
from ._values import DistributedValues, agreed, regroup
from ._variables import (
    Variable,
    bits_differ,
    filled_slot_variable,
    host_value,
    slot_variable,
    variable_label,
    which_differ,
)
from ._writes import Turn, commit, compute_copies, taking_turns

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence
    from typing import TypeAlias

    from ._backends import Device
    from ._collectives import ReductionEngine
    from ._context import ReplicaContext

    #: What a callable learning rate returns: a number, an array of shape () holding one, or
    #: a 0-d variable, read at each step.
    Rate: TypeAlias = float | np.floating[Any] | np.ndarray[Any, np.dtype[Any]] | Variable
    #: A number, a 0-d variable, a schedule of the step count, or a callable of no arguments.
    LearningRate: TypeAlias = float | Variable | Callable[[int], Rate] | Callable[[], Rate]
    #: Another float hyperparameter: a number, or a 0-d variable read at every step.
    Hyperparameter: TypeAlias = float | Variable

__all__ = [
    "ITERATIONS_RANGE",
    "MAX_ITERATIONS",
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "Optimizer",
    "RMSprop",
    "check_slots_to_restore",
    "restore_state",
    "slot_table",
    "slots_to_restore",
]

_T = TypeVar("_T")

#: The largest step count: a checkpoint keeps ``iterations`` as a 64-bit int.
MAX_ITERATIONS: Final = 2**63 - 1
#: What ``iterations`` must be, for the errors that refuse another value.
ITERATIONS_RANGE: Final = f"iterations must be an int from 0 to {MAX_ITERATIONS} (2**63 - 1)"


class _CallableList(list[_T]):
    """A list that returns itself when called, as tf.keras' ``CallableList``: so that
    ``optimizer.variables`` reads as Keras' property and as its older method alike."""

    __slots__ = ()

    def __call__(self) -> Self:
        return self


@final
class _Pairs:
    """One replica's checked gradients and their variables, handed to the merge round as one
    value: replicas that pass different numbers of pairs then reach it, which tells them so in
    ``apply_gradients()``'s words (as two lists, they would differ as merge_call arguments)."""

    __slots__ = ("grads", "variables")

    def __init__(self, grads: list[Any], variables: list[Variable]) -> None:
        self.grads = grads
        self.variables = variables


class Optimizer:
    """The base of every optimizer: steps, learning rate, slot variables, ``apply_gradients``.

    A subclass names its slots in ``slot_names`` and implements ``_update_step``, a pure
    function of one copy's arrays; a slot that does not start at zero says so in
    ``_step_slot_initial`` (and, if it reads a held hyperparameter, ``_slot_initial``).

    An optimizer belongs to one strategy, as in TF: the one in whose ``scope()`` it was
    created, else the one of its first step (the default strategy for steps outside any
    ``strategy.run()``). Its slots and step count are that strategy's, so a step in another
    strategy's run is refused. ``build()`` and ``Checkpoint.restore`` take no step: they leave
    an optimizer that belongs to no strategy yet as it is, and its first step decides; the
    ``build()`` of one that belongs to a strategy, and a restore into it, refuse the variables
    its steps would refuse.

    An optimizer cannot be copied or pickled (a ``TypeError``): make a fresh one with
    ``type(opt).from_config(opt.get_config())``, and keep its state in a ``Checkpoint``.

    Args:
        learning_rate: a number; a schedule ``learning_rate(step) -> float`` of the step
            count (``iterations`` before the step), like a Keras ``LearningRateSchedule``; or
            a callable of no arguments ``learning_rate() -> float``, like Keras' plain
            callables. A callable's signature decides, once, how it is called: one that can
            be called with no argument (whose parameters all have defaults, say) is called
            with none; one that needs a single positional argument, with the step count (as
            is one whose signature Python cannot read). Set ``learning_rate`` to change it.
            A callable may return a NumPy array of shape ``()`` (as ``np.where`` does), taken
            as the number it holds, as Keras takes a schedule's 0-d tensor.
            It may also be a 0-d ``aioreplica.Variable`` of an integer or float dtype, or a
            callable returning one, as tf.keras takes a ``tf.Variable``: read at the start of
            every step, so ``await lr.assign(x)`` between epochs sets the next steps' rate.
        weight_decay: if set, ``>= 0``: before its update, each variable (but those that
            ``exclude_from_weight_decay`` names) is decayed by
            ``w -= w * weight_decay * learning_rate``, with the step's learning rate (Keras'
            decoupled ``weight_decay``). ``None``: no decay.
        clipnorm: if set, each summed gradient ``g`` is scaled by ``min(1, clipnorm / ||g||)``
            before the update (Keras' ``clipnorm``).
        clipvalue: if set, each element of each summed gradient is clipped to
            ``[-clipvalue, clipvalue]`` before the update (Keras' ``clipvalue``).
        global_clipnorm: if set, all summed gradients are scaled together by
            ``min(1, global_clipnorm / sqrt(sum(||g_i||**2)))`` (Keras' ``global_clipnorm``);
            a non-finite joint norm makes the whole step NaN, as in Keras.

    At most one of ``clipnorm``, ``clipvalue`` and ``global_clipnorm`` can be set, as in
    Keras 3. A clipping bound of ``0`` clips nothing, as ``None``, as Keras reads it.

    Every float hyperparameter, these and each optimizer's own (``momentum``, ``beta_1``,
    ``epsilon``, ...), may be a 0-d ``aioreplica.Variable`` instead of a number: it is read,
    and checked as the constructor checks a number, at the start of every step (a value it
    refuses then fails that step, which changes nothing). ``get_config`` returns the variable;
    it is the program's, as the model's variables are: list it in a checkpoint to save it.

    Raises:
        TypeError: ``learning_rate`` is neither a number, a 0-d variable nor callable, or a
            callable that needs other arguments than none or the step count; ``weight_decay``
            or a clipping bound is not a number; a variable given for a hyperparameter is not
            0-d or holds no integer or float.
        ValueError: ``learning_rate`` is not finite; ``weight_decay`` is not finite or
            ``< 0``; a clipping bound is not finite or ``< 0``; more than one of
            ``clipnorm``, ``clipvalue`` and ``global_clipnorm`` is set.

    Example:
        >>> opt = aioreplica.optimizers.SGD(lambda step: 0.1 * 0.5**step)
        >>> opt.current_learning_rate()
        0.1
        >>> w = aioreplica.Variable([0.0, 0.0])
        >>> clipped = aioreplica.optimizers.SGD(1.0, clipnorm=1.0)
        >>> anyio.run(clipped.apply_gradients, [(np.array([3.0, 4.0]), w)])
        1
        >>> w.numpy().round(6)  # the gradient, of norm 5, scaled by 1 / 5
        array([-0.6, -0.8])
        >>> decayed = aioreplica.optimizers.SGD(0.5, weight_decay=0.1, clipvalue=1.0)
        >>> anyio.run(decayed.apply_gradients, [(np.array([3.0, 0.5]), w)])
        1
        >>> w.numpy().round(6)  # w * (1 - 0.1 * 0.5), then -0.5 * [1.0, 0.5]
        array([-1.07, -1.01])
        >>> lr = aioreplica.Variable(0.5, name="lr")
        >>> held = aioreplica.optimizers.SGD(lr)
        >>> anyio.run(lr.assign, 0.25)  # the next step's rate
        <aioreplica.Variable 'lr' shape=() dtype=float64 value=array(0.25)>
        >>> held.current_learning_rate()
        0.25
    """

    #: The names of the per-variable slots this optimizer keeps.
    slot_names: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        learning_rate: LearningRate,
        *,
        weight_decay: Hyperparameter | None = None,
        clipnorm: Hyperparameter | None = None,
        clipvalue: Hyperparameter | None = None,
        global_clipnorm: Hyperparameter | None = None,
    ) -> None:
        self._learning_rate: LearningRate
        self._learning_rate, self._rate_of_step = _learning_rate(learning_rate)
        # The hyperparameters given as variables, by name, with their checks: every step
        # reads them first.
        self._held: dict[str, tuple[Variable, Callable[[str, Any], Any]]] = {}
        self._weight_decay = self._hyper("weight_decay", weight_decay, _weight_decay)
        _clipping(clipnorm, clipvalue, global_clipnorm)  # at most one, each a bound
        self._clipnorm = self._hyper("clipnorm", clipnorm, _clip_bound)
        self._clipvalue = self._hyper("clipvalue", clipvalue, _clip_bound)
        self._global_clipnorm = self._hyper("global_clipnorm", global_clipnorm, _clip_bound)
        # What ``exclude_from_weight_decay`` named: variables by id (the entry holds the
        # variable, so the id stays valid) and parts of names.
        self._excluded: dict[int, Variable] = {}
        self._excluded_names: tuple[str, ...] = ()
        self._iterations = 0
        # Steps and restores take it in turn with the turns of the variables they write.
        self._turn = Turn()
        # id(variable) -> (variable, its slots in ``slot_names`` order). Keyed by id because
        # variables compare elementwise; the entry holds the variable, so the id stays valid.
        self._slots: dict[int, tuple[Variable, tuple[Variable, ...]]] = {}
        # The strategy this optimizer steps in (None: not decided yet), and how it was chosen.
        state = context_state.get()
        self._strategy: Any = (
            state.replica.strategy if state.replica is not None else state.strategy
        )
        self._bound_by = "it was created in its scope"

    @property
    def learning_rate(self) -> LearningRate:
        """The learning rate as given: a number, a 0-d variable, a schedule or a callable of
        no arguments.

        Setting it (as in Keras) changes the rate of the steps that start afterwards; the
        value is checked as the constructor checks it.

        Raises:
            TypeError, ValueError: on setting, a value the constructor refuses; the learning
                rate is then unchanged.

        Example:
            >>> opt = aioreplica.optimizers.SGD(0.1)
            >>> opt.learning_rate = lambda step: 0.5 / (step + 1)
            >>> opt.current_learning_rate()
            0.5
        """
        return self._learning_rate

    @learning_rate.setter
    def learning_rate(self, value: LearningRate) -> None:
        self._learning_rate, self._rate_of_step = _learning_rate(value)

    def current_learning_rate(self) -> float:
        """The learning rate the next step will use (a variable's value read now).

        Raises:
            TypeError: a callable learning rate returned something that is not a number or
                a 0-d variable holding one.
            ValueError: it returned a number that is not finite, or a variable holds one.

        Example:
            >>> aioreplica.optimizers.SGD(0.5).current_learning_rate()
            0.5
        """
        return _number(*self._given_rate())

    def _given_rate(self) -> tuple[str, Any]:
        """The learning rate of the next step before it is read as a number: what messages
        call it, and a number, a 0-d array or a variable (a callable's result, or itself)."""
        rate: Any = self._learning_rate
        if not callable(rate):  # a number, or a variable
            return "learning_rate", rate
        if self._rate_of_step:
            return f"learning_rate({self._iterations})", rate(self._iterations)
        return "learning_rate()", rate()

    async def _step_rate(self) -> tuple[float, Variable | None]:
        """The learning rate of the step that starts now, and the variable it was read from
        (if any), with every hyperparameter held in a variable read first (a GPU's copied to
        the host without blocking the event loop).

        Raises:
            TypeError, ValueError: as ``current_learning_rate``; a variable's value that its
                hyperparameter's check refuses.
            ValueError: a callable returned a multi-worker variable that still waits for the
                chief's value (``_check_synced``).
        """
        # Every value is read and checked before any is kept: a refused step changes nothing.
        values: dict[str, Any] = {}
        for name, (variable, check) in self._held.items():
            what = f"{name} (variable {variable.name!r})"
            _check_synced(what, variable)
            values[name] = check(what, (await host_value(variable)).item())
        what, rate = self._given_rate()
        source: Variable | None = None
        if isinstance(rate, Variable):
            _check_held(what, rate)
            what = f"{what} (variable {rate.name!r})"
            _check_synced(what, rate)
            source, rate = rate, (await host_value(rate)).item()
        rate = _number(what, rate)
        for name, value in values.items():
            setattr(self, f"_{name}", value)
        return rate, source

    def _hyper(self, name: str, value: Any, check: Callable[[str, Any], _T]) -> _T:
        """The constructor's argument ``name``, checked by ``check``; a 0-d variable given
        for it is kept, and read again (and checked) at the start of every step."""
        number = check(name, value)
        if isinstance(value, Variable):
            self._held[name] = (value, check)
        return number

    def _given(self, name: str) -> Any:
        """Hyperparameter ``name`` as given: its variable, if it is held in one."""
        held = self._held.get(name)
        return held[0] if held is not None else getattr(self, f"_{name}")

    @property
    def iterations(self) -> int:
        """How many steps ``apply_gradients`` has applied (restored by checkpoints).

        It can be set, to an int from 0 to ``2**63 - 1`` (a checkpoint keeps it as a 64-bit
        int), NumPy's integers included.

        Raises:
            TypeError: on setting, a value that is not an integer (a bool is not one).
            ValueError: on setting, an integer out of that range; the count is then unchanged.

        Example:
            >>> opt = aioreplica.optimizers.SGD(0.1)
            >>> opt.iterations = np.int64(10)
            >>> opt.iterations
            10
        """
        return self._iterations

    @iterations.setter
    def iterations(self, value: int) -> None:
        self._iterations = checked_integer(value, ITERATIONS_RANGE, 0, MAX_ITERATIONS)

    def build(self, var_list: Iterable[Variable]) -> None:
        """Create the slot variables of every variable in ``var_list`` that has none yet.

        ``apply_gradients`` does this on first use; call it to read slots before the first
        step. (``Checkpoint.restore`` makes the slots it restores itself, refusing the
        variables this refuses.)

        Raises:
            TypeError: ``var_list`` is a single variable, or not iterable; an item is not an
                ``aioreplica.Variable``.
            ValueError: this optimizer belongs to a strategy (see ``Optimizer``) and a
                variable does not: one of another strategy, or, unless that is the default
                strategy, one made outside any scope (its steps would refuse either). Nothing
                is built then, for any variable of ``var_list``.

        Example:
            >>> opt = aioreplica.optimizers.SGD(0.1, momentum=0.9)
            >>> w = aioreplica.Variable(np.ones(2), name="w")
            >>> opt.build([w])
            >>> opt.get_slot(w, "momentum").numpy()
            array([0., 0.])
        """
        variables = _variable_list("build", var_list)
        for variable in variables:  # all checked before any slot is made
            self._check_builds(variable)
        for variable in variables:
            if id(variable) not in self._slots:
                self._slots[id(variable)] = (variable, self._new_slots(variable))

    def _check_builds(
        self, variable: Variable, caller: str = "build()", made: str = "built"
    ) -> None:
        """Refuse to make slots for ``variable`` that this optimizer's steps would refuse to
        train (``_check_owner``): they would be made on another strategy's devices. ``caller``
        (``build()``, or a restore) begins the message, which says nothing was ``made``.

        Raises:
            ValueError: naming the variable and both strategies.
        """
        owner, mine = variable._strategy, self._strategy
        if mine is None or _trains(mine, owner):
            return
        if owner is None:
            raise ValueError(
                f"{caller}: variable {variable.name!r} was created outside any strategy scope, "
                f"but this {type(self).__name__} belongs to {mine!r} ({self._bound_by}), whose "
                f"steps would refuse it; nothing was {made}: create model variables inside "
                "`with strategy.scope():`"
            )
        raise ValueError(
            f"{caller}: variable {variable.name!r} belongs to {owner!r}, but this "
            f"{type(self).__name__} belongs to {_told_apart(mine, owner, _label)} "
            f"({self._bound_by}), whose steps would refuse it; nothing was {made}: use an "
            "optimizer only with its own strategy's variables, and create one optimizer per "
            "strategy, inside `with strategy.scope():`"
        )

    def get_slot(self, var: Variable, slot_name: str) -> Variable:
        """Return the slot variable ``slot_name`` of ``var``.

        Raises:
            ValueError: this optimizer has no such slot, or none for ``var`` yet.

        Example:
            >>> opt = aioreplica.optimizers.Adam()
            >>> w = aioreplica.Variable(0.0)
            >>> opt.build([w])
            >>> opt.get_slot(w, "v").shape
            ()
        """
        if slot_name not in self.slot_names:
            raise ValueError(
                f"{type(self).__name__} has no slot {slot_name!r}; its slots are "
                f"{list(self.slot_names)}"
            )
        entry = self._slots.get(id(var))
        if entry is None:
            raise ValueError(
                f"{type(self).__name__} has no slots for variable "
                f"{getattr(var, 'name', var)!r} yet: they are made by its first "
                "apply_gradients() or by build()"
            )
        return entry[1][self.slot_names.index(slot_name)]

    @property
    def variables(self) -> _CallableList[Variable]:
        """Every slot variable, in the order their variables were first seen, then in
        ``slot_names`` order: a list, which can also be called, as in tf.keras (so both
        ``opt.variables`` and ``opt.variables()`` give it).

        Keras also lists its ``iterations`` and learning-rate variables: here ``iterations`` is
        an int and a learning rate is no variable of the optimizer's own (one given as a
        variable is the program's), so the list holds the slots only.

        Example:
            >>> opt = aioreplica.optimizers.Adam(0.1)
            >>> opt.build([aioreplica.Variable([1.0, 2.0], name="w")])
            >>> [slot.name for slot in opt.variables]
            ['w/m', 'w/v']
            >>> opt.variables() == opt.variables
            True
        """
        return _CallableList([slot for _, slots in self._slots.values() for slot in slots])

    def exclude_from_weight_decay(
        self, var_list: Iterable[Variable] | None = None, var_names: Iterable[str] | None = None
    ) -> None:
        """Leave some variables out of ``weight_decay``, as Keras' method of that name.

        Each call replaces what the previous one excluded (as in Keras), and takes effect from
        the next step: a step already started decays as it began to.

        Args:
            var_list: the variables to leave out.
            var_names: parts of names: a variable whose ``name`` contains any of them is left
                out (``["bias"]`` leaves out every bias). Keras reads them as regular
                expressions; here they are plain substrings.

        Raises:
            TypeError: ``var_list`` is a single variable, or neither ``None`` nor iterable;
                an item of it is not an ``aioreplica.Variable``; ``var_names`` is a string
                (not a list of strings), neither ``None`` nor iterable, or holds something
                other than strings. Nothing is excluded differently then.

        Example:
            >>> w = aioreplica.Variable([1.0], name="dense/kernel")
            >>> b = aioreplica.Variable([1.0], name="dense/bias")
            >>> opt = aioreplica.optimizers.SGD(0.5, weight_decay=0.2)
            >>> opt.exclude_from_weight_decay(var_names=["bias"])
            >>> anyio.run(opt.apply_gradients, [(np.zeros(1), w), (np.zeros(1), b)])
            1
            >>> w.numpy(), b.numpy()  # only the kernel decayed: 1 - 1 * 0.2 * 0.5
            (array([0.9]), array([1.]))
        """
        variables = (
            [] if var_list is None else _variable_list("exclude_from_weight_decay", var_list)
        )
        if isinstance(var_names, str):
            raise TypeError(
                f"exclude_from_weight_decay(): var_names must be a list of strings, got the "
                f"string {var_names!r}; pass [{var_names!r}] to exclude the variables whose "
                "names contain it"
            )
        if var_names is not None and not _iterable(var_names):
            raise TypeError(
                "exclude_from_weight_decay(): var_names must be a list of strings, got "
                f"{type(var_names).__name__} {var_names!r:.60}"
            )
        names = () if var_names is None else tuple(var_names)
        for name in names:
            if not isinstance(name, str):
                raise TypeError(
                    "exclude_from_weight_decay(): var_names must hold strings, got "
                    f"{type(name).__name__} {name!r:.60}"
                )
        self._excluded = {id(variable): variable for variable in variables}
        self._excluded_names = names

    def _decays(self, variable: Variable) -> bool:
        """Whether ``weight_decay`` applies to ``variable`` (Keras' ``_use_weight_decay``)."""
        if self._weight_decay is None or id(variable) in self._excluded:
            return False
        return not any(part in variable.name for part in self._excluded_names)

    async def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[Any, Variable]],
        name: str | None = None,
        experimental_aggregate_gradients: bool = True,
        *,
        skip_gradients_aggregation: bool = False,
    ) -> int:
        """Apply one step: sum every gradient across replicas, then update every variable.

        Call it from every replica (or outside any strategy, with ordinary variables) with
        that replica's gradients. It takes one merge round, whose gradients are summed in one
        packed all-reduce; scale your loss by the global batch size so the sum is the mean.
        Pairs whose gradient is ``None`` are skipped. An empty list changes nothing (with
        several replicas it still takes its merge round, where replicas that passed pairs are
        told that another passed none; across workers, a worker whose replicas all passed
        none makes every worker raise ``WorkersDisagree``). Every variable, slot and
        the step count change together, or (on any error or cancellation) none of them. With
        ``clipnorm``, ``clipvalue`` or ``global_clipnorm``, the summed gradients are clipped in
        that same round, so every replica applies the same clipped step; with
        ``weight_decay``, the variables are decayed in it too, before their update.

        Args:
            grads_and_vars: ``(gradient, variable)`` pairs; gradients are arrays of their
                variable's shape on this replica's device.
            name: TF's name of the operation, accepted and unused.
            experimental_aggregate_gradients: ``False``: the gradients are aggregated
                already (say by ``await ctx.all_reduce("sum", grads)``), so they are applied
                as they are, not summed again. A variable's copies stay equal, so every
                replica (of every worker) must then pass the same gradient, bit for bit.
            skip_gradients_aggregation: Keras's name for
                ``experimental_aggregate_gradients=False``.

        Returns:
            ``iterations`` after the step.

        Raises:
            ValueError: pairs whose gradients are all ``None``; a variable listed twice; a
                gradient of the wrong shape or that is no array (naming the variable and the
                replica); a variable whose gradient is ``None`` on some replicas only; a
                variable of another strategy, or of a strategy when called outside
                ``strategy.run()``; an optimizer that belongs to another strategy (naming
                both); without aggregation, gradients that differ between replicas (naming
                the variables); replicas that pass different numbers of pairs (naming them
                and the numbers); ``iterations`` is ``2**63 - 1`` already, the most a
                checkpoint keeps; a callable learning rate returned a multi-worker variable
                that still waits for the chief's value (read it on every worker first).
            TypeError: ``grads_and_vars`` is not iterable; an item is not a pair of gradient
                and ``aioreplica.Variable``; a variable that is not of a floating-point (or
                complex) dtype; a bool gradient (its elements would be summed as numbers; an
                integer one is cast to the variable's dtype, as Keras casts it); a gradient
                dtype that cannot be cast to its variable's; an aggregation flag that is not a
                bool.
            RuntimeError: called in cross-replica context (``strategy.scope()`` or a merge
                function): call it inside ``strategy.run``.
            NotImplementedError: the optimizer's class does not implement ``_update_step``
                (the base class ``Optimizer``, or a subclass written for Keras'
                ``update_step``).

        Example:
            >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with strategy.scope():
            ...     w = aioreplica.Variable(np.zeros(2), name="w")
            >>> opt = aioreplica.optimizers.SGD(0.1)
            >>> async def step():
            ...     return await opt.apply_gradients([(np.ones(2), w)])
            >>> anyio.run(strategy.run, step)
            1
            >>> w.numpy()
            array([-0.2, -0.2])
        """
        ctx = get_replica_context()
        if ctx is None:
            raise RuntimeError(
                "apply_gradients() was called in cross-replica context; call it from the "
                "step function inside strategy.run(), where each replica passes its gradients"
            )
        if _without_update(type(self)):  # before anything is made
            raise NotImplementedError(_missing_update(type(self)))
        try:
            if self._strategy is not None and self._strategy is not ctx.strategy:
                raise self._foreign(ctx.strategy)
            aggregate = _aggregating(experimental_aggregate_gradients, skip_gradients_aggregation)
            grads, variables, skipped = self._checked_pairs(ctx, grads_and_vars)
        except (TypeError, ValueError) as exc:
            ctx._engine.refusing("apply_gradients()", exc)  # on every worker alike
            raise
        if not variables and ctx.num_replicas_in_sync == 1:  # nothing to apply: TF's no-op
            return self._iterations
        engine = ctx._engine  # a collective, bounded as one by timeout_seconds
        iterations: int = await ctx._collective(
            self._merge_apply,
            (engine, _Pairs(grads, variables), aggregate, skipped),
            engine.options._timeout,
        )
        return iterations

    def _checked_pairs(
        self, ctx: ReplicaContext, grads_and_vars: Iterable[tuple[Any, Variable]]
    ) -> tuple[list[Any], list[Variable], bool]:
        """This replica's gradients (checked, cast, on its device), their variables, and
        whether some gradients were ``None``.

        A ``None`` gradient stays in its place, unchecked, so that the merge can tell a
        variable skipped by every replica from one that only some replicas skip.
        """
        replica_id = ctx.replica_id_in_sync_group
        grads: list[Any] = []
        variables: list[Variable] = []
        seen: set[int] = set()
        strategy, device = ctx.strategy, ctx.device
        if not hasattr(grads_and_vars, "__iter__") or isinstance(grads_and_vars, str | bytes):
            raise TypeError(
                "apply_gradients() takes an iterable of (gradient, variable) pairs, got "
                f"{type(grads_and_vars).__name__} {grads_and_vars!r:.60}"
            )
        pairs = 0
        for pair in grads_and_vars:
            grad, variable = _check_pair(pair)
            pairs += 1
            if grad is None:
                grads.append(None)
                variables.append(variable)
                continue
            if id(variable) in seen:
                raise ValueError(
                    f"apply_gradients(): variable {variable.name!r} is listed twice; sum its "
                    "gradients first"
                )
            seen.add(id(variable))
            if variable._dtype.kind not in "fc":
                raise TypeError(
                    f"apply_gradients(): variable {variable.name!r} has dtype "
                    f"{variable.dtype}, but optimizers update floating-point (or complex) "
                    "variables only: an update of another dtype would be truncated; make it "
                    "a float variable, or leave it out of grads_and_vars"
                )
            if variable._strategy is not strategy:
                self._check_owner(variable, strategy)
            grads.append(_checked_gradient(grad, variable, device, replica_id))
            variables.append(variable)
        if pairs and not seen:
            raise ValueError(
                f"apply_gradients() got no gradients: every one of its {pairs} pairs' gradient "
                "is None; compute the gradients of the variables the loss depends on"
            )
        return grads, variables, len(seen) != pairs

    async def _merge_apply(
        self,
        strategy: Any,
        engine: ReductionEngine,
        pairs: Any,
        aggregate: Any,
        skipped: Any,
    ) -> int:
        """The merge round: one packed all-reduce, every new copy computed, then one commit.

        The gradients were checked and cast to their variables' dtypes in each replica, and
        every variable lives on the engine's devices (its owner was checked there too), so
        they go straight to the engine's reduction, one array per replica each. ``None``
        gradients (``skipped`` on some replica) hold their places until they are left out.
        """
        try:
            grads, variables = _regrouped(pairs, engine.first_replica)
            if skipped is not False:
                grads, variables = _with_gradients(grads, variables, engine.first_replica)
            variables = [
                variable
                if not isinstance(variable, DistributedValues)  # the same on every replica
                else agreed(variable, f"the variable of pair {i} of apply_gradients()")
                for i, variable in enumerate(variables)
            ]
            aggregate = agreed(aggregate, "whether apply_gradients() aggregates the gradients")
        except (ReplicaSyncError, ValueError) as exc:
            await engine.refuse("apply_gradients()", exc)  # on every worker alike
            raise
        if not variables:  # every replica passed an empty list: nothing to apply
            return self._iterations
        # Every turn at once, in the global order, so that no two steps or restores can wait
        # for each other; a slot made by a step that ran while this one waited included.
        async with taking_turns(lambda: self._turns(variables)):
            # A step of another strategy's run may have decided whose optimizer it is while
            # this one waited for its turn.
            if self._strategy is not None and self._strategy is not strategy:
                error = self._foreign(strategy)
                await engine.refuse("apply_gradients()", error)  # on every worker alike
                raise error
            if self._iterations >= MAX_ITERATIONS:  # a step now would leave it unsaveable
                error = ValueError(
                    f"apply_gradients() of {type(self).__name__} was refused: iterations is "
                    f"{self._iterations} (2**63 - 1), the most a checkpoint keeps, so another "
                    "step would take it out of range; nothing was changed: set "
                    "optimizer.iterations to a smaller count to go on"
                )
                await engine.refuse("apply_gradients()", error)  # on every worker alike
                raise error
            try:
                rate, source = await self._step_rate()
            except (TypeError, ValueError) as exc:
                await engine.refuse("apply_gradients()", exc)  # on every worker alike
                raise
            # Decided now: an exclude_from_weight_decay() while this step awaits is for the next.
            decays = [self._decays(variable) for variable in variables]
            if engine.cluster is None:
                return await self._apply(
                    engine, grads, variables, aggregate, strategy, rate, decays
                )
            # Every worker's step must be of the same variables, in the same order, by an
            # optimizer set alike (else the copies drift apart): its reductions say so, and
            # the workers compare that before any data moves.
            trained = ", ".join(map(variable_label, variables))
            setting = self._setting(rate, source, decays)
            try:
                with reductions_for(f"apply_gradients() of {trained} by {setting}"):
                    return await self._apply(
                        engine, grads, variables, aggregate, strategy, rate, decays
                    )
            except WorkersDisagree as exc:
                add_note(
                    exc,
                    f"this worker's apply_gradients() trains {trained} by {setting}; every "
                    "worker must pass the same variables in the same order, with gradients of "
                    "the same shapes and dtypes, to optimizers of the same class, "
                    "hyperparameters, learning rate, step count and weight-decay exclusions",
                )
                raise

    def _setting(self, rate: float, source: Variable | None, decays: list[bool]) -> str:
        """What this step's optimizer is, as the workers compare it: its class, learning rate
        (and ``source``, the variable it was read from, if any), step count, other
        hyperparameters and which variables decay."""
        config = {  # a hyperparameter held in a variable as this step reads it
            key: getattr(self, f"_{key}") if key in self._held else value
            for key, value in self.get_config().items()
            if key != "learning_rate"
        }
        shown = ", ".join(f"{key}={value!r}" for key, value in config.items())
        held = "" if source is None else f" (variable {source.name!r})"
        # The rate and step count first, as they differ most often between workers (a rate
        # set per worker): a disagreement shows only the start of each worker's words.
        setting = f"{type(self).__name__}(rate {rate!r}{held}, step {self._iterations}, {shown})"
        if self._weight_decay is not None:
            setting += f", decaying {''.join('1' if decayed else '0' for decayed in decays)}"
        return setting

    def _turns(self, variables: list[Variable]) -> list[Turn]:
        """The turns a step of ``variables`` holds: the optimizer's, theirs and their slots'."""
        turns = [self._turn]
        slots = self._slots
        for variable in variables:
            turns.append(variable._turn)
            entry = slots.get(id(variable))
            if entry is not None:
                turns += [slot._turn for slot in entry[1]]
        return turns

    async def _apply(
        self,
        engine: ReductionEngine,
        grads: list[Any],
        variables: list[Variable],
        aggregate: bool,
        strategy: Any,
        rate: float,
        decays: list[bool],
    ) -> int:
        step = self._iterations
        per_replica = [
            grad.values if isinstance(grad, DistributedValues) else (grad,) * engine.size
            for grad in grads
        ]
        if aggregate:
            summed = await engine.all_reduce_arrays(ReduceOp.SUM, per_replica, engine.options)
        else:
            summed = await _the_same_gradients(engine, per_replica, variables)
        made: dict[int, tuple[Variable, tuple[Variable, ...]]] = {}
        updates: list[tuple[Variable, list[Any]]] = []
        xp = engine.devices[0].xp  # one backend for every device of a strategy
        scales: tuple[list[Any], ...] = ()  # per copy, the global clipping factor, if any
        if self._global_clipnorm:  # None or 0: no clipping
            scales = (await _global_scales(engine.devices, summed, self._global_clipnorm),)
        # The update of a variable that does not decay, and of one that does.
        update_steps = [
            self._clipped(
                functools.partial(
                    self._cast_step,
                    xp=xp,
                    rate=rate,
                    step=step,
                    decay=self._weight_decay if decayed else None,
                ),
                xp,
            )
            for decayed in (False, True)
        ]
        # Every variable's update in one job per copy: its inputs, one after another.
        targets: list[tuple[Variable, ...]] = []
        inputs: list[Sequence[Any]] = []
        for variable, grad in zip(variables, summed, strict=True):
            entry = self._slots.get(id(variable))
            if entry is None:
                entry = made[id(variable)] = (variable, await self._filled_slots(variable))
            slots = entry[1]
            targets.append((variable, *slots))
            inputs += [variable._copies, grad, *scales, *(slot._copies for slot in slots)]
        arities = [len(owned) + 1 + len(scales) for owned in targets]
        steps = [update_steps[decayed] for decayed in decays]
        new = await compute_copies(
            engine.devices, functools.partial(_update_all, steps, arities), inputs
        )
        position = 0
        for owned in targets:
            for target in owned:
                updates.append((target, [results[position] for results in new]))
                position += 1
        # build() is synchronous and may have made slots for a variable while this step
        # awaited: they are new and unwritten, so this step's values go into them.
        for key, (_, own) in made.items():
            built = self._slots.get(key)
            if built is not None:
                swap = dict(zip(map(id, own), built[1], strict=True))
                updates = [(swap.get(id(target), target), copies) for target, copies in updates]
        # The all-or-nothing point: nothing above changed any state.
        commit(updates)
        for key, entry in made.items():
            self._slots.setdefault(key, entry)
        if self._strategy is None:
            self._strategy = strategy
            self._bound_by = "its first step was in it"
        self._iterations = step + 1
        return self._iterations

    def _clipped(
        self, update_step: Callable[..., tuple[Any, ...]], xp: Any
    ) -> Callable[..., tuple[Any, ...]]:
        """``update_step`` with this optimizer's gradient clipping, if any, done first."""
        # A bound of None or 0 clips nothing, as in Keras.
        if self._clipnorm:
            return functools.partial(_clipped_step, update_step, xp, self._clipnorm)
        if self._clipvalue:
            return functools.partial(_value_clipped_step, update_step, xp, self._clipvalue)
        if self._global_clipnorm:
            return functools.partial(_scaled_step, update_step)
        return update_step

    def _cast_step(
        self,
        var: Any,
        grad: Any,
        *slots: Any,
        xp: Any,
        rate: float,
        step: int,
        decay: float | None = None,
    ) -> tuple[Any, ...]:
        if decay is not None:
            # Keras' ``_apply_weight_decay``: before the update, in its order of operations
            # (``variable - variable * wd * lr``), with the hyperparameters in the variable's
            # dtype, as Python floats are.
            var = var - var * decay * rate
        # Gradients arrive in the variable's dtype (cast per replica before the merge); the
        # results are cast back, since Python-float hyperparameters may promote them.
        results = self._update_step(xp, var, grad, slots, rate, step)
        dtype = var.dtype
        cast = tuple(
            [
                r if type(r) is np.ndarray and r.dtype == dtype else xp.asarray(r).astype(dtype)
                for r in results
            ]
        )
        if len(cast) != 1 + len(slots) or any(r.shape != var.shape for r in cast):
            raise ValueError(
                f"{type(self).__name__}._update_step returned {len(cast)} arrays of shapes "
                f"{[tuple(r.shape) for r in cast]}, but it must return the new variable and "
                f"its {len(slots)} slots, each of the variable's shape {tuple(var.shape)}; "
                "nothing was changed"
            )
        return cast

    def _update_step(
        self, xp: Any, var: Any, grad: Any, slots: Sequence[Any], rate: float, step: int
    ) -> tuple[Any, ...]:
        """One copy's new ``(var, *slots)`` from its arrays; ``step`` counts from 0.

        What a subclass implements: a pure function of one copy's arrays (``xp`` is their
        array module, NumPy or CuPy; ``slots`` are in ``slot_names`` order; ``rate`` is the
        step's learning rate), returning the new variable and each new slot, all of the
        variable's shape. It writes nothing: every copy's results are committed together.

        Raises:
            NotImplementedError: always, here in the base class.
        """
        raise NotImplementedError(_missing_update(type(self)))

    def _slot_initial(self, slot_name: str) -> float:
        """The value every element of a new slot ``slot_name`` made outside a step starts at
        (``build()``, a restore's reset), with any hyperparameter held in a variable read now."""
        return self._step_slot_initial(slot_name)

    def _step_slot_initial(self, slot_name: str) -> float:
        """``_slot_initial`` for a slot a step makes, from the values read at its start."""
        return 0.0

    def _new_slots(self, variable: Variable) -> tuple[Variable, ...]:
        return tuple(
            slot_variable(
                variable, f"{variable.name}/{name}", initial_value=self._slot_initial(name)
            )
            for name in self.slot_names
        )

    async def _filled_slots(self, variable: Variable) -> tuple[Variable, ...]:
        """``_new_slots``, filled on the devices (a step's are; ``build()``'s cannot be)."""
        return tuple(
            [
                await filled_slot_variable(
                    variable, f"{variable.name}/{name}", initial_value=self._step_slot_initial(name)
                )
                for name in self.slot_names
            ]
        )

    def _foreign(self, strategy: Any) -> ValueError:
        """The error of a step in ``strategy``'s run by an optimizer of another strategy."""
        owner = self._strategy
        stepper = _told_apart(strategy, owner, _label)
        return ValueError(
            f"apply_gradients() of {type(self).__name__} was called in {stepper}, but this "
            f"optimizer belongs to {_label(owner)} ({self._bound_by}); its slots and step "
            "count are that strategy's, and nothing was changed: create one optimizer per "
            "strategy, inside `with strategy.scope():`"
        )

    def _check_owner(self, variable: Variable, strategy: Any) -> None:
        owner = variable._strategy
        if _trains(strategy, owner):
            return
        if strategy is default_replica_context().strategy:  # outside any run()
            raise ValueError(
                f"apply_gradients() was called outside strategy.run() for variable "
                f"{variable.name!r} of {owner!r}; call it from the step function inside "
                "strategy.run(), where each replica passes its gradients"
            )
        if owner is None:
            raise ValueError(
                f"variable {variable.name!r} was created outside any strategy scope, but is "
                f"trained in {strategy!r}; create model variables inside "
                "`with strategy.scope():`"
            )
        trainer = _told_apart(strategy, owner, repr)
        raise ValueError(
            f"variable {variable.name!r} belongs to {owner!r}, but is trained in {trainer}; "
            "train each variable with the strategy that created it"
        )

    def get_config(self) -> dict[str, Any]:
        """The hyperparameters, as keyword arguments of the constructor.

        Example:
            >>> aioreplica.optimizers.SGD(0.1, clipnorm=1.0).get_config()
            ... # doctest: +NORMALIZE_WHITESPACE
            {'learning_rate': 0.1, 'momentum': 0.0, 'nesterov': False, 'weight_decay': None,
             'clipnorm': 1.0, 'global_clipnorm': None, 'clipvalue': None}
        """
        return {"learning_rate": self._learning_rate, **self._base_config()}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Self:
        """An optimizer of this class made from ``config``, a ``get_config()`` dictionary
        (Keras' ``from_config``); it has no slots and no steps yet.

        Raises:
            TypeError: ``config`` names an argument this class does not take, or as the
                constructor.
            ValueError: as the constructor.

        Example:
            >>> adam = aioreplica.optimizers.Adam(0.01, amsgrad=True)
            >>> aioreplica.optimizers.Adam.from_config(adam.get_config()).get_config() == (
            ...     adam.get_config()
            ... )
            True
        """
        return cls(**config)

    def _base_config(self) -> dict[str, Any]:
        """The arguments every optimizer takes, in Keras' order."""
        return {
            "weight_decay": self._given("weight_decay"),
            "clipnorm": self._given("clipnorm"),
            "global_clipnorm": self._given("global_clipnorm"),
            "clipvalue": self._given("clipvalue"),
        }

    def __repr__(self) -> str:
        # None only ever means "off" (no clipping): left out, to keep the repr short.
        config = ", ".join(
            f"{key}={value!r}" for key, value in self.get_config().items() if value is not None
        )
        return f"{type(self).__name__}({config})"

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        """Refused: an optimizer cannot be copied (``copy.copy``, ``copy.deepcopy``) or
        pickled. Its slots are variables on its strategy's devices, and its steps take their
        turns with theirs: a shallow copy would share the slots but count its own steps, and
        none of it travels to another process.

        Raises:
            TypeError: always, naming the optimizer, how to make a fresh one and how to keep
                its state.

        Example:
            >>> import copy
            >>> opt = aioreplica.optimizers.SGD(0.1, momentum=0.9)
            >>> copy.copy(opt)  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            TypeError: cannot copy or pickle SGD(learning_rate=0.1, momentum=0.9, ...
            >>> type(opt).from_config(opt.get_config())  # a fresh one: no slots, no steps
            SGD(learning_rate=0.1, momentum=0.9, nesterov=False)
        """
        raise TypeError(
            f"cannot copy or pickle {self!r}: its slots are variables of its strategy and its "
            "steps take their turns with theirs, so a copy would share some of its state and "
            "not the rest; make a fresh optimizer with the same hyperparameters with "
            "type(opt).from_config(opt.get_config()) (no slots, no steps yet), and keep an "
            "optimizer's step count and slots in an aioreplica.Checkpoint (restore it into "
            "the fresh one)"
        )


MERGE_CALLS[Optimizer._merge_apply] = "an optimizer step (apply_gradients)"


@final
class SGD(Optimizer):
    """Gradient descent, with optional (Nesterov) momentum, as Keras' ``SGD``.

    ``momentum == 0``: ``w -= lr * g``. Otherwise, with a ``momentum`` slot ``m``:
    ``m = momentum * m - lr * g``, then ``w += m`` (or, with ``nesterov``,
    ``w += momentum * m - lr * g``).

    Args:
        learning_rate: a number, a schedule ``step -> rate`` or a callable of no arguments,
            as ``Optimizer``.
        momentum: in ``[0, 1]``.
        nesterov: use Nesterov momentum.
        weight_decay, clipnorm, clipvalue, global_clipnorm: weight decay and gradient
            clipping, as ``Optimizer``.

    Raises:
        ValueError: ``momentum`` outside ``[0, 1]``; as ``Optimizer``.
        TypeError: ``nesterov`` is not a bool; as ``Optimizer``.

    Example:
        >>> w = aioreplica.Variable([1.0])
        >>> opt = SGD(0.5, momentum=0.9)
        >>> anyio.run(opt.apply_gradients, [(np.array([1.0]), w)])
        1
        >>> w.numpy(), opt.get_slot(w, "momentum").numpy()
        (array([0.5]), array([-0.5]))
    """

    def __init__(
        self,
        learning_rate: LearningRate = 0.01,
        momentum: Hyperparameter = 0.0,
        nesterov: bool = False,
        *,
        weight_decay: Hyperparameter | None = None,
        clipnorm: Hyperparameter | None = None,
        clipvalue: Hyperparameter | None = None,
        global_clipnorm: Hyperparameter | None = None,
    ) -> None:
        super().__init__(
            learning_rate,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
        )
        self._momentum = self._hyper("momentum", momentum, _closed_fraction)
        self._nesterov = _flag("nesterov", nesterov)
        # An instance attribute: whether SGD keeps a slot depends on its momentum (one held in
        # a variable may change, so it keeps one).
        keeps = self._momentum or "momentum" in self._held
        self.slot_names = ("momentum",) if keeps else ()  # type: ignore[misc]

    def _update_step(
        self, xp: Any, var: Any, grad: Any, slots: Sequence[Any], rate: float, step: int
    ) -> tuple[Any, ...]:
        if not slots:
            return (var - rate * grad,)
        momentum = self._momentum * slots[0] - rate * grad
        if self._nesterov:
            return (var + self._momentum * momentum - rate * grad, momentum)
        return (var + momentum, momentum)

    def get_config(self) -> dict[str, Any]:
        return {
            "learning_rate": self._learning_rate,
            "momentum": self._given("momentum"),
            "nesterov": self._nesterov,
            **self._base_config(),
        }


class Adam(Optimizer):
    """Adam, as Keras' ``Adam``: slots ``m`` and ``v`` (first and second moments), then
    ``velocity_hat`` with ``amsgrad``.

    With ``t = iterations + 1``: ``m += (g - m) * (1 - beta_1)``,
    ``v += (g**2 - v) * (1 - beta_2)``, and
    ``w -= m * lr * sqrt(1 - beta_2**t) / (1 - beta_1**t) / (sqrt(v) + epsilon)``. With
    ``amsgrad`` (Keras' AMSGrad), ``velocity_hat = maximum(velocity_hat, v)`` takes the place
    of ``v`` in that denominator.

    Args:
        learning_rate: a number, a schedule ``step -> rate`` or a callable of no arguments,
            as ``Optimizer``.
        beta_1: decay of the first moment, in ``[0, 1)``.
        beta_2: decay of the second moment, in ``[0, 1)``.
        epsilon: added to the denominator, ``> 0``.
        amsgrad: divide by the largest second moment seen so far, in an extra slot
            ``velocity_hat`` (Keras' name; checkpoints keep it like the other slots).
        weight_decay, clipnorm, clipvalue, global_clipnorm: weight decay and gradient
            clipping, as ``Optimizer``.

    Raises:
        ValueError: a beta outside ``[0, 1)``, ``epsilon <= 0``, a non-finite number; as
            ``Optimizer``.
        TypeError: ``amsgrad`` is not a bool; as ``Optimizer``.

    Example:
        >>> w = aioreplica.Variable([1.0])
        >>> anyio.run(Adam(0.1).apply_gradients, [(np.array([2.0]), w)])
        1
        >>> w.numpy().round(6)
        array([0.9])
        >>> opt = Adam(0.1, amsgrad=True)
        >>> anyio.run(opt.apply_gradients, [(np.array([2.0]), w)])
        1
        >>> opt.slot_names, opt.get_slot(w, "velocity_hat").numpy().round(6)
        (('m', 'v', 'velocity_hat'), array([0.004]))
    """

    slot_names: ClassVar[tuple[str, ...]] = ("m", "v")

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        beta_1: Hyperparameter = 0.9,
        beta_2: Hyperparameter = 0.999,
        epsilon: Hyperparameter = 1e-7,
        amsgrad: bool = False,
        *,
        weight_decay: Hyperparameter | None = None,
        clipnorm: Hyperparameter | None = None,
        clipvalue: Hyperparameter | None = None,
        global_clipnorm: Hyperparameter | None = None,
    ) -> None:
        super().__init__(
            learning_rate,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
        )
        self._beta_1 = self._hyper("beta_1", beta_1, _fraction)
        self._beta_2 = self._hyper("beta_2", beta_2, _fraction)
        self._epsilon = self._hyper("epsilon", epsilon, _positive)
        self._amsgrad = _flag("amsgrad", amsgrad)
        if self._amsgrad:
            # An instance attribute: whether Adam keeps a third slot depends on amsgrad.
            self.slot_names = ("m", "v", "velocity_hat")  # type: ignore[misc]

    def _update_step(
        self, xp: Any, var: Any, grad: Any, slots: Sequence[Any], rate: float, step: int
    ) -> tuple[Any, ...]:
        m, v = slots[0], slots[1]
        t = step + 1
        alpha = rate * math.sqrt(1.0 - self._beta_2**t) / (1.0 - self._beta_1**t)
        m = m + (grad - m) * (1.0 - self._beta_1)
        v = v + (grad * grad - v) * (1.0 - self._beta_2)
        if not self._amsgrad:
            return (var - m * alpha / (xp.sqrt(v) + self._epsilon), m, v)
        velocity_hat = xp.maximum(slots[2], v)
        return (var - m * alpha / (xp.sqrt(velocity_hat) + self._epsilon), m, v, velocity_hat)

    def get_config(self) -> dict[str, Any]:
        return {
            "learning_rate": self._learning_rate,
            "beta_1": self._given("beta_1"),
            "beta_2": self._given("beta_2"),
            "epsilon": self._given("epsilon"),
            "amsgrad": self._amsgrad,
            **self._base_config(),
        }


@final
class AdamW(Adam):
    """Adam with decoupled weight decay, as Keras' ``AdamW``: ``Adam`` whose ``weight_decay``
    is on by default and must be a number.

    Each step first decays the weight, ``w -= w * weight_decay * lr`` (with that step's
    learning rate), then takes ``Adam``'s step from the decayed weight. The decay is not part
    of the gradient, so it is neither summed across replicas nor clipped; variables that
    ``exclude_from_weight_decay`` names are not decayed.

    Args:
        learning_rate: a number, a schedule ``step -> rate`` or a callable of no arguments,
            as ``Optimizer``.
        weight_decay: the decay per unit of learning rate, ``>= 0`` (``0`` is ``Adam``).
        beta_1, beta_2, epsilon, amsgrad: as ``Adam``.
        clipnorm, clipvalue, global_clipnorm: gradient clipping, as ``Optimizer``.

    Raises:
        ValueError: ``weight_decay`` is ``None`` or ``< 0`` (as Keras'); as ``Adam``.
        TypeError: ``weight_decay`` is not a number; as ``Adam``.

    Example:
        >>> w = aioreplica.Variable([1.0])
        >>> opt = AdamW(0.1, weight_decay=0.5)
        >>> anyio.run(opt.apply_gradients, [(np.array([2.0]), w)])
        1
        >>> w.numpy().round(6)  # 1 - 1 * 0.5 * 0.1, then Adam's first step of -0.1
        array([0.85])
    """

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        weight_decay: Hyperparameter = 0.004,
        beta_1: Hyperparameter = 0.9,
        beta_2: Hyperparameter = 0.999,
        epsilon: Hyperparameter = 1e-7,
        amsgrad: bool = False,
        *,
        clipnorm: Hyperparameter | None = None,
        clipvalue: Hyperparameter | None = None,
        global_clipnorm: Hyperparameter | None = None,
    ) -> None:
        super().__init__(
            learning_rate,
            beta_1,
            beta_2,
            epsilon,
            amsgrad,
            weight_decay=_not_none("weight_decay", weight_decay),
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
        )

    def get_config(self) -> dict[str, Any]:
        # The weight decay right after the learning rate, as in the signature.
        return {
            "learning_rate": self._learning_rate,
            "weight_decay": self._given("weight_decay"),
            **super().get_config(),
        }


@final
class Adagrad(Optimizer):
    """Adagrad, as Keras' ``Adagrad``: slot ``accumulator``, the running sum of squared
    gradients.

    The accumulator starts at ``initial_accumulator_value`` (not zero); each step,
    ``accumulator += g**2``, then ``w -= lr * g / sqrt(accumulator + epsilon)``.

    Args:
        learning_rate: a number, a schedule ``step -> rate`` or a callable of no arguments,
            as ``Optimizer``.
        initial_accumulator_value: the accumulator's starting value, ``>= 0``.
        epsilon: added to the accumulator under the square root, ``> 0``.
        weight_decay, clipnorm, clipvalue, global_clipnorm: weight decay and gradient
            clipping, as ``Optimizer``.

    Raises:
        ValueError: ``initial_accumulator_value < 0``, ``epsilon <= 0``, a non-finite number;
            as ``Optimizer``.
        TypeError: a hyperparameter that is not a number; as ``Optimizer``.

    Example:
        >>> w = aioreplica.Variable([1.0])
        >>> opt = Adagrad(0.1)
        >>> anyio.run(opt.apply_gradients, [(np.array([2.0]), w)])
        1
        >>> opt.get_slot(w, "accumulator").numpy()  # 0.1 + 2**2
        array([4.1])
        >>> w.numpy().round(6)  # 1 - 0.1 * 2 / sqrt(4.1 + 1e-7)
        array([0.901227])
    """

    slot_names = ("accumulator",)

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        initial_accumulator_value: Hyperparameter = 0.1,
        epsilon: Hyperparameter = 1e-7,
        *,
        weight_decay: Hyperparameter | None = None,
        clipnorm: Hyperparameter | None = None,
        clipvalue: Hyperparameter | None = None,
        global_clipnorm: Hyperparameter | None = None,
    ) -> None:
        super().__init__(
            learning_rate,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
        )
        self._initial_accumulator_value = self._hyper(
            "initial_accumulator_value", initial_accumulator_value, _non_negative
        )
        self._epsilon = self._hyper("epsilon", epsilon, _positive)

    def _slot_initial(self, slot_name: str) -> float:
        held = self._held.get("initial_accumulator_value")
        if held is None:
            return self._initial_accumulator_value
        variable = held[0]  # read now, on the calling thread, as build() makes its slots
        return _non_negative(f"initial_accumulator_value (variable {variable.name!r})", variable)

    def _step_slot_initial(self, slot_name: str) -> float:
        return self._initial_accumulator_value

    def _update_step(
        self, xp: Any, var: Any, grad: Any, slots: Sequence[Any], rate: float, step: int
    ) -> tuple[Any, ...]:
        accumulator = slots[0] + grad * grad
        return (var - rate * grad / xp.sqrt(accumulator + self._epsilon), accumulator)

    def get_config(self) -> dict[str, Any]:
        return {
            "learning_rate": self._learning_rate,
            "initial_accumulator_value": self._given("initial_accumulator_value"),
            "epsilon": self._given("epsilon"),
            **self._base_config(),
        }


@final
class RMSprop(Optimizer):
    """RMSprop, as Keras' ``RMSprop``: slot ``velocity``, then ``momentum`` if
    ``momentum > 0``, then ``average_gradient`` if ``centered``.

    Each step, ``velocity = rho * velocity + (1 - rho) * g**2``. Centered:
    ``average_gradient = rho * average_gradient + (1 - rho) * g`` and
    ``denominator = velocity - average_gradient**2 + epsilon``; otherwise
    ``denominator = velocity + epsilon``. With ``increment = lr * g / sqrt(denominator)``:
    ``momentum > 0``: ``m = momentum * m + increment``, then ``w -= m``; otherwise
    ``w -= increment``.

    Args:
        learning_rate: a number, a schedule ``step -> rate`` or a callable of no arguments,
            as ``Optimizer``.
        rho: decay of the mean square (and of the mean gradient), in ``[0, 1]``.
        momentum: in ``[0, 1]``; ``0`` keeps no ``momentum`` slot.
        epsilon: added to the denominator under the square root, ``> 0``.
        centered: divide by an estimate of the gradient's variance, not its mean square.
        weight_decay, clipnorm, clipvalue, global_clipnorm: weight decay and gradient
            clipping, as ``Optimizer``.

    Raises:
        ValueError: ``rho`` outside ``[0, 1]``, ``momentum`` outside ``[0, 1]``,
            ``epsilon <= 0``, a non-finite number; as ``Optimizer``.
        TypeError: a hyperparameter that is not a number; ``centered`` is not a bool; as
            ``Optimizer``.

    Example:
        >>> w = aioreplica.Variable([1.0])
        >>> opt = RMSprop(0.1)
        >>> anyio.run(opt.apply_gradients, [(np.array([2.0]), w)])
        1
        >>> opt.get_slot(w, "velocity").numpy().round(6)  # (1 - 0.9) * 2**2
        array([0.4])
        >>> w.numpy().round(6)  # 1 - 0.1 * 2 / sqrt(0.4 + 1e-7)
        array([0.683772])
    """

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        rho: Hyperparameter = 0.9,
        momentum: Hyperparameter = 0.0,
        epsilon: Hyperparameter = 1e-7,
        centered: bool = False,
        *,
        weight_decay: Hyperparameter | None = None,
        clipnorm: Hyperparameter | None = None,
        clipvalue: Hyperparameter | None = None,
        global_clipnorm: Hyperparameter | None = None,
    ) -> None:
        super().__init__(
            learning_rate,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
        )
        self._rho = self._hyper("rho", rho, _closed_fraction)
        self._momentum = self._hyper("momentum", momentum, _closed_fraction)
        self._epsilon = self._hyper("epsilon", epsilon, _positive)
        self._centered = _flag("centered", centered)
        # An instance attribute: which slots RMSprop keeps depends on momentum (one held in a
        # variable may change, so it keeps one) and centered.
        keeps = self._momentum > 0 or "momentum" in self._held
        self.slot_names = (  # type: ignore[misc]
            "velocity",
            *(("momentum",) if keeps else ()),
            *(("average_gradient",) if self._centered else ()),
        )

    def _update_step(
        self, xp: Any, var: Any, grad: Any, slots: Sequence[Any], rate: float, step: int
    ) -> tuple[Any, ...]:
        rho = self._rho
        velocity = rho * slots[0] + (1.0 - rho) * (grad * grad)
        new_slots = [velocity]
        if self._centered:
            average_gradient = rho * slots[-1] + (1.0 - rho) * grad
            denominator = velocity - average_gradient * average_gradient + self._epsilon
        else:
            denominator = velocity + self._epsilon
        increment = rate * grad / xp.sqrt(denominator)
        if "momentum" in self.slot_names:
            momentum = self._momentum * slots[1] + increment
            new_slots.append(momentum)
            var = var - momentum
        else:
            var = var - increment
        if self._centered:
            new_slots.append(average_gradient)
        return (var, *new_slots)

    def get_config(self) -> dict[str, Any]:
        return {
            "learning_rate": self._learning_rate,
            "rho": self._given("rho"),
            "momentum": self._given("momentum"),
            "epsilon": self._given("epsilon"),
            "centered": self._centered,
            **self._base_config(),
        }


# -- gradient clipping ----------------------------------------------------------------------
#
# Every function here runs on one copy's arrays, with that copy's array module ``xp`` (NumPy
# or CuPy): norms and factors stay 0-d device arrays, so a GPU step never waits on the host.


def _update_all(
    update_steps: Sequence[Callable[..., tuple[Any, ...]]], arities: Sequence[int], *inputs: Any
) -> tuple[Any, ...]:
    """One copy's new arrays for every variable of a step: ``update_steps[i]`` on variable
    ``i``'s inputs (``arities[i]`` of them, one after another), results concatenated."""
    results: list[Any] = []
    start = 0
    for update_step, arity in zip(update_steps, arities, strict=True):
        results += update_step(*inputs[start : start + arity])
        start += arity
    return tuple(results)


def _clipped_step(
    update_step: Callable[..., tuple[Any, ...]],
    xp: Any,
    clipnorm: float,
    var: Any,
    grad: Any,
    *slots: Any,
) -> tuple[Any, ...]:
    """``update_step`` with ``grad`` scaled down to norm ``clipnorm`` if it is longer."""
    norm = xp.sqrt(_squared_norm(xp, grad))
    return update_step(var, _times(grad, _clip_factor(xp, norm, clipnorm)), *slots)


def _value_clipped_step(
    update_step: Callable[..., tuple[Any, ...]],
    xp: Any,
    clipvalue: float,
    var: Any,
    grad: Any,
    *slots: Any,
) -> tuple[Any, ...]:
    """``update_step`` with each element of ``grad`` clipped to ``[-clipvalue, clipvalue]``
    (Keras' ``ops.clip``; a NaN stays NaN)."""
    return update_step(var, xp.clip(grad, -clipvalue, clipvalue), *slots)


def _scaled_step(
    update_step: Callable[..., tuple[Any, ...]], var: Any, grad: Any, scale: Any, *slots: Any
) -> tuple[Any, ...]:
    """``update_step`` with ``grad`` times ``scale``, this copy's global clipping factor."""
    return update_step(var, _times(grad, scale), *slots)


async def _global_scales(
    devices: Sequence[Device], summed: Sequence[Sequence[Any]], clipnorm: float
) -> list[Any]:
    """Per copy, the factor that scales all of its summed gradients to joint norm ``clipnorm``.

    Each device computes its own from its copies (equal on every replica after the sum), so
    the factor is ready on the device that uses it. Host replicas share their summed arrays:
    the host computes it once.
    """
    scales: list[Any] = []
    done: dict[tuple[int, ...], Any] = {}
    for i, device in enumerate(devices):
        grads = [per_copy[i] for per_copy in summed]
        key = tuple(map(id, grads))
        if key not in done:
            # The whole pass reads every gradient: its size decides inline or worker thread.
            nbytes = sum(getattr(grad, "nbytes", 0) for grad in grads)
            done[key] = await device.compute(nbytes, _global_scale, device.xp, clipnorm, *grads)
        scales.append(done[key])
    return scales


def _global_scale(xp: Any, clipnorm: float, *grads: Any) -> Any:
    norm = xp.sqrt(sum(_squared_norm(xp, grad) for grad in grads))
    # As Keras: a step with an infinite or NaN gradient turns NaN, instead of silently
    # shrinking to nothing.
    return xp.where(xp.isfinite(norm), _clip_factor(xp, norm, clipnorm), xp.nan)


def _squared_norm(xp: Any, grad: Any) -> Any:
    return xp.vdot(grad, grad).real  # one pass; conjugates complex gradients


def _clip_factor(xp: Any, norm: Any, clipnorm: float) -> Any:
    # ``clipnorm / max(norm, clipnorm)`` is ``min(1, clipnorm / norm)`` without dividing by
    # a zero norm (Keras' ``clip_by_norm``).
    return clipnorm / xp.maximum(norm, clipnorm)


def _times(grad: Any, scale: Any) -> Any:
    # In the gradient's own precision: the joint norm of float32 and float64 gradients is a
    # float64, which must not widen a float32 gradient, and with it the whole update.
    if grad.dtype.kind in "fc":
        scale = scale.astype(grad.dtype, copy=False)
    return grad * scale


# -- for checkpoints ------------------------------------------------------------------------


def slot_table(optimizer: Optimizer) -> list[tuple[Variable, tuple[Variable, ...]]]:
    """Every variable ``optimizer`` keeps slots for, with its slots in ``slot_names`` order."""
    return list(optimizer._slots.values())


def slots_to_restore(optimizer: Optimizer, variable: Variable) -> tuple[Variable, ...]:
    """``variable``'s slots: the existing ones, or new ones not yet registered (see below)."""
    entry = optimizer._slots.get(id(variable))
    return entry[1] if entry is not None else optimizer._new_slots(variable)


def check_slots_to_restore(optimizer: Optimizer, variable: Variable) -> None:
    """Refuse ``variable`` if ``slots_to_restore`` would make slots for it that ``build()``
    refuses (of another strategy than the optimizer's).

    Raises:
        ValueError: naming the variable and both strategies.
    """
    if id(variable) not in optimizer._slots:
        optimizer._check_builds(variable, "Checkpoint.restore()", "restored")


def restore_state(
    optimizer: Optimizer, iterations: int, slots: Sequence[tuple[Variable, tuple[Variable, ...]]]
) -> None:
    """Set the step count and register slots made for a restore (part of its commit)."""
    for variable, variable_slots in slots:
        optimizer._slots.setdefault(id(variable), (variable, variable_slots))
    optimizer._iterations = iterations


# -- checks ---------------------------------------------------------------------------------


def _number(what: str, value: Any) -> float:
    """``value`` as a float: a real number, NumPy's included, an array of shape ``()``
    holding one (what a schedule built of ``np.where`` returns, as Keras' return 0-d tensors),
    or a 0-d variable holding one, read now.

    Raises:
        TypeError: anything else (a bool, a complex number, an array or a variable of another
            shape or dtype).
        ValueError: a number that is not finite.
    """
    if isinstance(value, Variable):
        _check_held(what, value)
        value = value.numpy()
    held = value
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "iuf":
        held = value[()]
    if isinstance(held, bool) or not isinstance(held, int | float | np.integer | np.floating):
        raise TypeError(
            f"{what} must be a number, got {type(value).__name__} {value!r:.60}; pass a "
            f"number, or {_HELD}"
        )
    number = float(held)
    if not math.isfinite(number):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return number


def _check_synced(what: str, variable: Variable) -> None:
    """Refuse to read hyperparameter ``what`` in a step from ``variable`` of a multi-worker
    strategy that still waits for its first sync (the chief's value). A run of its strategy
    makes that sync first, and so does the read that keeps a variable given for a
    hyperparameter; one that a callable returns, read in a step of another strategy, would
    be this worker's own initial value instead: the sync is a collective that every worker
    must make, which such a step does not.

    Raises:
        ValueError: naming the variable, its strategy and what to do.
    """
    if variable._unsynced:
        raise ValueError(
            f"{what} belongs to {variable._strategy!r} and still waits for its first value "
            "from the chief, which this step of another strategy cannot fetch (every worker "
            "takes it together), so it would read this worker's own initial value; nothing "
            "was changed: read it on every worker first (its numpy()), or run a step of its "
            "strategy first"
        )


#: The other form a float hyperparameter takes, for the errors that refuse a value.
_HELD: Final = "a 0-d aioreplica.Variable holding one (read at the start of every step)"


def _check_held(what: str, variable: Variable) -> None:
    """Refuse a variable that cannot hold hyperparameter ``what``.

    Raises:
        TypeError: ``variable`` is not 0-d, or its dtype is not an integer or float one.
    """
    if variable.shape != () or variable.dtype.kind not in "iuf":
        raise TypeError(
            f"{what} must be a number, got {type(variable).__name__} {variable.name!r} of "
            f"shape {variable.shape} and dtype {variable.dtype}; pass a number, or {_HELD}: "
            "an integer or float variable of shape ()"
        )


def _not_none(what: str, value: Any) -> Any:
    """``value``, which must be given (a number or a variable, checked later).

    Raises:
        ValueError: ``value`` is ``None`` (as Keras' ``AdamW`` refuses it).
    """
    if value is None:
        raise ValueError(f"{what} must be a number, got None; pass a number, or {_HELD}")
    return value


def _fraction(what: str, value: Any) -> float:
    """``value``, a number in ``[0, 1)`` (Adam's betas).

    Raises:
        TypeError, ValueError: as ``_number``; a number outside ``[0, 1)``.
    """
    number = _number(what, value)
    if not 0.0 <= number < 1.0:
        raise ValueError(f"{what} must be in [0, 1), got {number!r}")
    return number


def _closed_fraction(what: str, value: Any) -> float:
    """``value``, a number in ``[0, 1]`` (momentum, RMSprop's ``rho``).

    Raises:
        TypeError, ValueError: as ``_number``; a number outside ``[0, 1]``.
    """
    number = _number(what, value)
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"{what} must be in [0, 1], got {number!r}")
    return number


def _positive(what: str, value: Any) -> float:
    """``value``, a number ``> 0`` (``epsilon``).

    Raises:
        TypeError, ValueError: as ``_number``; a number ``<= 0``.
    """
    number = _number(what, value)
    if number <= 0:
        raise ValueError(f"{what} must be > 0, got {number!r}")
    return number


def _non_negative(what: str, value: Any) -> float:
    """``value``, a number ``>= 0`` (Adagrad's ``initial_accumulator_value``).

    Raises:
        TypeError, ValueError: as ``_number``; a number ``< 0``.
    """
    number = _number(what, value)
    if number < 0:
        raise ValueError(f"{what} must be >= 0, got {number!r}")
    return number


def _learning_rate(value: Any) -> tuple[LearningRate, bool]:
    """A checked learning rate, and whether it is a callable to call with the step count.

    Raises:
        TypeError: not a number, nor a callable that can be called with no argument or with
            the step count alone.
        ValueError: a number that is not finite.
    """
    if isinstance(value, Variable):
        _number("learning_rate", value)
        return value, False
    if not callable(value):
        try:
            return _number("learning_rate", value), False
        except TypeError as exc:
            raise TypeError(
                f"{exc}; or a callable of no arguments, or a schedule called with the step "
                "count, learning_rate(step), each returning either"
            ) from None
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):  # no signature to read (some builtins): as a schedule
        return value, True
    for of_step, args in ((False, ()), (True, (0,))):
        try:
            signature.bind(*args)
        except TypeError:
            continue
        return value, of_step
    name = getattr(value, "__name__", type(value).__name__)
    raise TypeError(
        "learning_rate must be a number, a callable of no arguments or a schedule called with "
        f"the step count, learning_rate(step); got {name}{signature}, which is neither"
    )


def _flag(what: str, value: Any) -> bool:
    """``value`` as a bool, if it is one (NumPy's included).

    Raises:
        TypeError: anything else (``"no"`` would be true).
    """
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{what} must be True or False, got {value!r:.60}")
    return bool(value)


#: What each clipping argument clips, for the error that refuses two of them.
_CLIPS: Final = {
    "clipnorm": "each gradient by its own norm",
    "clipvalue": "each element to [-clipvalue, clipvalue]",
    "global_clipnorm": "all of them by their joint norm",
}


def _clipping(
    clipnorm: Any, clipvalue: Any, global_clipnorm: Any
) -> tuple[float | None, float | None, float | None]:
    """The checked clipping bounds, of which Keras 3 allows one at most.

    Raises:
        ValueError: more than one is set; one is not finite or ``< 0``.
        TypeError: one is not a number.
    """
    given = {
        name: value
        for name, value in (
            ("clipnorm", clipnorm),
            ("clipvalue", clipvalue),
            ("global_clipnorm", global_clipnorm),
        )
        if value is not None
    }
    if len(given) > 1:
        shown = [f"{name}={value!r}" for name, value in given.items()]
        first, *others = given
        meanings = [f"{first} clips {_CLIPS[first]}", *(f"{n} {_CLIPS[n]}" for n in others)]
        raise ValueError(
            f"{', '.join(shown[:-1])} and {shown[-1]} were {'both' if len(given) == 2 else 'all'}"
            f" given; pick one: {', '.join(meanings)}"
        )
    return (
        _clip_bound("clipnorm", clipnorm),
        _clip_bound("clipvalue", clipvalue),
        _clip_bound("global_clipnorm", global_clipnorm),
    )


def _clip_bound(what: str, value: Any) -> float | None:
    """The checked clipping bound ``what``: ``None`` or ``0`` (no clipping: Keras clips only
    by a bound ``> 0``), or a finite number ``> 0``.

    Raises:
        TypeError: not a number.
        ValueError: not finite, or ``< 0``.
    """
    if value is None:
        return None
    bound = _number(what, value)
    if bound < 0:
        raise ValueError(f"{what} must be >= 0 (0 or None: no clipping), got {bound!r}")
    return bound


def _weight_decay(what: str, value: Any) -> float | None:
    """The checked weight decay: ``None`` (none), or a finite number ``>= 0``.

    Raises:
        TypeError: not a number.
        ValueError: not finite, or ``< 0``.
    """
    if value is None:
        return None
    decay = _number(what, value)
    if decay < 0:
        raise ValueError(f"{what} must be >= 0 (0: no decay), got {decay!r}")
    return decay


def _iterable(value: Any) -> bool:
    """Whether ``value`` can be iterated over (as ``iter()`` tells)."""
    try:
        iter(value)
    except TypeError:
        return False
    return True


def _variable_list(method: str, var_list: Any) -> list[Variable]:
    """``var_list``, the argument of the optimizer's ``method``, as a list of variables, each
    checked.

    Raises:
        TypeError: a single variable (which iterates over its elements), something that is
            not iterable, or an item that is not an ``aioreplica.Variable``.
    """
    if isinstance(var_list, Variable):
        raise TypeError(
            f"{method}(): var_list must be a list of variables, got the single variable "
            f"{var_list.name!r} (whose elements it would go through); pass a list holding it, "
            f"as in opt.{method}([variable])"
        )
    if not _iterable(var_list):
        raise TypeError(
            f"{method}(): var_list must be a list of aioreplica.Variable objects, got "
            f"{type(var_list).__name__} {var_list!r:.60}"
        )
    variables = list(var_list)
    for variable in variables:
        _check_variable(variable)
    return variables


def _check_variable(variable: Any) -> Variable:
    if not isinstance(variable, Variable):
        raise TypeError(
            f"expected an aioreplica.Variable, got {type(variable).__name__}; create model "
            "parameters with aioreplica.Variable(...) (inside strategy.scope())"
        )
    return variable


def _aggregating(experimental_aggregate_gradients: Any, skip_gradients_aggregation: Any) -> bool:
    """Whether ``apply_gradients`` sums the gradients across replicas, from TF's and Keras's
    flags.

    Raises:
        TypeError: a flag that is not a bool (``"no"`` would be true).
    """
    aggregate = _flag(
        "apply_gradients(): experimental_aggregate_gradients", experimental_aggregate_gradients
    )
    skip = _flag("apply_gradients(): skip_gradients_aggregation", skip_gradients_aggregation)
    return aggregate and not skip


async def _the_same_gradients(
    engine: ReductionEngine, per_replica: Sequence[Sequence[Any]], variables: list[Variable]
) -> list[list[Any]]:
    """The gradients of a step without aggregation: each replica's own, once every replica (of
    every worker) is known to have passed the same bits, so that the copies stay equal (TF
    would let them drift apart).

    Raises:
        ValueError: some replicas passed different gradients, naming the variables (and
            this process's differing replicas); refused on every worker alike.
    """
    differ = await bits_differ(engine, per_replica)
    if any(differ):
        odd = [i for i, d in enumerate(differ) if d]
        error = ValueError(
            "apply_gradients() without aggregation: the replicas passed different gradients "
            f"for {', '.join(repr(variables[i].name) for i in odd)}"
            f"{await which_differ(per_replica[odd[0]], engine)}; every replica must pass the same "
            "gradient, since a variable's copies stay equal: all-reduce them first "
            "(`await ctx.all_reduce('sum', grads)`), or let apply_gradients() sum them"
        )
        await engine.refuse("apply_gradients()", error)  # on every worker alike
        raise error
    return [list(grads) for grads in per_replica]


def _trains(strategy: Any, owner: Any) -> bool:
    """Whether steps in ``strategy`` train a variable of ``owner`` (its strategy, or ``None``
    outside any scope): their own, or the default strategy one made outside any scope."""
    return owner is strategy or (owner is None and strategy is default_replica_context().strategy)


def _label(strategy: Any) -> str:
    """``strategy`` as messages name it: the default strategy says it is."""
    if strategy is default_replica_context().strategy:
        return f"the default strategy {strategy!r} (outside any strategy.run())"
    return repr(strategy)


def _told_apart(strategy: Any, owner: Any, shown: Callable[[Any], str]) -> str:
    """``strategy`` as a message names it beside ``owner``: ``shown(strategy)``, unless the
    two look alike (two strategies over the same devices), which the message then says."""
    if repr(strategy) == repr(owner):
        return f"another {strategy!r}: two strategy objects over the same devices"
    return shown(strategy)


def _without_update(cls: type[Optimizer]) -> bool:
    """Whether ``cls`` has no update of its own that a step calls: it does not implement
    ``_update_step``, or a class of its own, below the one that does, defines Keras'
    ``update_step`` (which a step would silently leave uncalled)."""
    if cls._update_step is Optimizer._update_step:
        return True
    for klass in cls.__mro__:
        if "_update_step" in vars(klass):
            return False
        if "update_step" in vars(klass):
            return True
    return False


def _missing_update(cls: type[Optimizer]) -> str:
    """Why an optimizer of class ``cls``, which does not implement ``_update_step``, cannot
    take a step, and what to do."""
    how = (
        "implement _update_step(self, xp, var, grad, slots, rate, step), returning the new "
        "variable and its slots (in slot_names order) computed from one copy's arrays, or "
        "use SGD, Adam, AdamW, Adagrad or RMSprop; nothing was changed"
    )
    if hasattr(cls, "update_step"):  # written for Keras, whose update_step assigns
        return (
            f"{cls.__name__} defines Keras' update_step(gradient, variable, learning_rate), "
            "which aioreplica does not call: a step computes every copy of every variable and "
            "slot first and commits them all at once, so nothing may assign during it; "
            f"{how}"
        )
    return f"{cls.__name__} cannot apply gradients: an Optimizer subclass must {how}"


def _regrouped(pairs: Any, first_replica: int) -> tuple[list[Any], list[Any]]:
    """The gradients and the variables of a step, each regrouped across the replicas (a
    ``PerReplica`` where they differ), from every replica's ``_Pairs`` (``first_replica``: the
    id of the first replica here, for messages).

    Raises:
        ValueError: replicas passed different numbers of pairs, naming them and the numbers.
    """
    if not isinstance(pairs, DistributedValues):  # one replica
        return pairs.grads, pairs.variables
    parts = pairs.values
    counts = [len(part.variables) for part in parts]
    odd = [i for i, count in enumerate(counts) if count != counts[0]]
    if odd:
        others = " and ".join(f"replica {first_replica + i} passed {counts[i]}" for i in odd)
        raise ValueError(
            f"apply_gradients(): replica {first_replica} passed {counts[0]} (gradient, "
            f"variable) pair{'' if counts[0] == 1 else 's'}, but {others}; every replica must "
            "pass the same variables, in the same order: pass zeros as the gradient of a "
            "variable that a replica's loss does not depend on"
        )
    grads = regroup([part.grads for part in parts], first_replica=first_replica)
    variables = regroup([part.variables for part in parts], first_replica=first_replica)
    return grads, variables


def _with_gradients(
    grads: list[Any], variables: list[Any], first_replica: int
) -> tuple[list[Any], list[Any]]:
    """The gradients and variables of a step without the pairs whose gradient every replica
    passed as ``None`` (``first_replica``: the id of the first replica here, for messages).

    Raises:
        ValueError: variables whose gradient is ``None`` on some replicas only, naming them
            and those replicas.
    """
    kept_grads: list[Any] = []
    kept_variables: list[Any] = []
    mixed: list[str] = []
    for grad, variable in zip(grads, variables, strict=True):
        if grad is None:  # None on every replica: the variable is not trained
            continue
        if isinstance(grad, DistributedValues) and any(part is None for part in grad.values):
            given = [i for i, part in enumerate(grad.values) if part is not None]
            nones = [i for i, part in enumerate(grad.values) if part is None]
            if isinstance(variable, DistributedValues):  # named as a replica that trains it
                variable = variable.values[given[0]]
            mixed.append(
                f"{variable.name!r} (None on {replica_list([first_replica + i for i in nones])}"
                f", not on {replica_list([first_replica + i for i in given])})"
            )
            continue
        kept_grads.append(grad)
        kept_variables.append(variable)
    if mixed:
        raise ValueError(
            "apply_gradients(): some replicas passed None for a gradient that others passed: "
            f"{', '.join(mixed)}; every replica must pass a gradient for the same variables: "
            "pass zeros for a variable that a replica's loss does not depend on"
        )
    return kept_grads, kept_variables


def _check_pair(pair: Any) -> tuple[Any, Variable]:
    if type(pair) is tuple and len(pair) == 2 and isinstance(pair[1], Variable):
        return pair  # the common case
    if not isinstance(pair, tuple | list) or len(pair) != 2:
        raise TypeError(
            f"apply_gradients() takes (gradient, variable) pairs, got {type(pair).__name__} "
            f"{pair!r:.60}"
        )
    grad, variable = pair
    return grad, _check_variable(variable)


def _checked_gradient(grad: Any, variable: Variable, device: Any, replica_id: int) -> Any:
    """The gradient on this replica's device, or an error naming the variable and replica."""
    if (
        type(grad) is np.ndarray
        and grad.dtype == variable._dtype
        and grad.shape == variable._shape
        and device.kind == "cpu"
    ):
        return grad  # the common case: a host array of the variable's shape and dtype
    try:
        array = device.asarray(grad)
    except (TypeError, ValueError) as exc:  # a ragged list, say
        kind = TypeError if isinstance(exc, TypeError) else ValueError
        raise kind(
            f"apply_gradients(): the gradient of variable {variable.name!r} from replica "
            f"{replica_id} is no array ({exc}); pass an array (or a nested list) of the "
            f"variable's shape {variable.shape}"
        ) from exc
    if array.dtype.kind == "b":
        raise TypeError(
            f"apply_gradients(): the gradient of variable {variable.name!r} from replica "
            f"{replica_id} has dtype bool, which is no gradient: its True and False would be "
            "summed across replicas as 1 and 0; pass a gradient of a float dtype"
        )
    if array.dtype.kind not in "iufc" or not np.can_cast(
        array.dtype, variable._dtype, casting="same_kind"
    ):
        raise TypeError(
            f"apply_gradients(): the gradient of variable {variable.name!r} from replica "
            f"{replica_id} has dtype {array.dtype}, which cannot be cast to the variable's "
            f"{variable.dtype}"
        )
    if tuple(array.shape) != variable._shape:
        raise ValueError(
            f"apply_gradients(): the gradient of variable {variable.name!r} from replica "
            f"{replica_id} has shape {tuple(array.shape)}, but the variable has shape "
            f"{variable.shape}"
        )
    # In the variable's dtype, so every replica's gradients reduce alike.
    return array.astype(variable._dtype, copy=False)
