"""Many steps in one call: ``strategy.run_steps`` and TF's ``MultiStepContext``.

``run_steps`` starts the replicas once and keeps them for every step: each replica loops, and
at the top of each step one merge round takes the next element of the distributed iterator in
cross-replica context and hands every replica its slice. So a step costs one merge round, not
a ``run()`` start (spawning a task per replica), and the replicas stay in lockstep: a failure
in any step ends the loop and comes out as ``run()``'s failures do.

``experimental_run_steps_on_iterator`` is TF's older loop, kept for code written against it:
its ``fn(context, inputs)`` runs in cross-replica context once per step, calls
``strategy.run`` itself, and records outputs in the ``MultiStepContext``.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any, Final, final

from . import _tree
from ._context import MERGE_CALLS, context_state, default_replica_context, get_replica_context
from ._errors import add_note, as_integer, made_by_yield, yielding_step
from ._values import DistributedValues, misfit, shown_misfit

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._options import ReduceOp

__all__ = ["MultiStepContext", "run_steps", "run_steps_on_iterator"]


class _End:
    """What the merge round hands every replica when there is no next step."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<no more steps>"


_END: Final = _End()


def _check_iterator(iterator: Any, caller: str) -> AsyncIterator[Any]:
    if isinstance(iterator, AsyncIterator):
        return iterator
    if hasattr(iterator, "__aiter__"):
        return aiter(iterator)
    raise TypeError(
        f"{caller} needs an async iterator of distributed batches, such as "
        f"aiter(strategy.distribute_dataset(...)), got {type(iterator).__name__}"
    )


def _check_steps(steps: Any, name: str) -> int:
    count = as_integer(steps)
    if count is None:
        raise TypeError(f"{name} must be an int, got {type(steps).__name__} {steps!r}")
    if count < 0:
        raise ValueError(f"{name} must be >= 0, got {count}")
    return count


@final
class _Feed:
    """The iterator of a ``run_steps`` call, pulled once per step by the merge round."""

    __slots__ = ("iterator", "pulled", "remaining")

    def __init__(self, iterator: AsyncIterator[Any], steps: int) -> None:
        self.iterator = iterator
        self.remaining = steps
        self.pulled = 0  # elements pulled so far

    async def next_element(self, strategy: Any) -> Any:
        if self.remaining == 0:
            return _END
        try:
            element = await anext(self.iterator)
        except StopAsyncIteration:
            self.remaining = 0
            return _END
        except Exception as exc:  # the iterator's own error: say where it came from
            add_note(
                exc,
                f"raised by run_steps()'s iterator ({type(self.iterator).__name__}) pulling "
                f"the element of step {self.pulled + 1}",
            )
            raise
        self.pulled += 1
        self.remaining -= 1
        found = misfit(element, strategy._engine.size)
        if found is not None:
            raise ValueError(
                f"run_steps(): the iterator gave {shown_misfit(found)}, but {strategy!r} has "
                f"{strategy._engine.size} replicas here; iterate a dataset distributed by this "
                "strategy"
            )
        return element

    def merge_call_words(self) -> str:
        """The merge round of ``next_element`` in words, for messages (``_scheduler``)."""
        return f"run_steps pulling the element of step {self.pulled + 1}"


MERGE_CALLS[_Feed.next_element] = "run_steps pulling the element of a step"


async def run_steps(strategy: Any, step_fn: Callable[[Any], Any], iterator: Any, steps: int) -> Any:
    """``strategy.run_steps``: see its docstring."""

    def checked() -> tuple[AsyncIterator[Any], int]:
        if not callable(step_fn):
            raise TypeError(f"run_steps() needs a callable step_fn, got {type(step_fn).__name__}")
        return _check_iterator(iterator, "run_steps()"), _check_steps(steps, "steps")

    feed = _Feed(*await strategy._accepted("run_steps()", checked, "steps"))

    async def replica_loop() -> Any:
        context = get_replica_context()
        assert context is not None  # run() runs this in a replica
        result = None
        while True:
            element = await context.merge_call(feed.next_element)
            if element is _END:
                return result
            step = feed.pulled  # this step's number, before another pull moves it on
            try:
                result = step_fn(element)
                if inspect.isawaitable(result):
                    result = await result
                elif made_by_yield(step_fn, result):
                    raise yielding_step("run_steps' step_fn", result)
            except Exception as exc:
                add_note(exc, f"raised in step {step} of run_steps()")
                raise

    return await strategy.run(replica_loop)


@final
class MultiStepContext:
    """What the steps of ``experimental_run_steps_on_iterator`` record, as in TF.

    ``fn(context, inputs)`` receives it on every step. Outputs set in a step replace those of
    the step before, so after the loop ``last_step_outputs`` holds the last step's.

    Example:
        >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> batches = aioreplica.batched(np.arange(8.0), 4)
        >>> async def fn(context, inputs):
        ...     loss = await strategy.run(lambda x: float(x.sum()), args=(inputs,))
        ...     await context.set_last_step_output("loss", loss, reduce_op="sum")
        >>> async def main():
        ...     iterator = aiter(strategy.distribute_dataset(batches))
        ...     run = strategy.extended.experimental_run_steps_on_iterator
        ...     context = await run(fn, iterator, iterations=2)
        ...     return float(context.last_step_outputs["loss"])
        >>> anyio.run(main)
        22.0
    """

    __slots__ = ("_last_step_outputs", "_non_tensor_outputs", "_reduce_ops")

    def __init__(self) -> None:
        self._last_step_outputs: dict[str, Any] = {}
        self._reduce_ops: dict[str, ReduceOp | str | None] = {}
        self._non_tensor_outputs: dict[str, Any] = {}

    @property
    def last_step_outputs(self) -> dict[str, Any]:
        """The outputs of the last step by name: reduced ones as reduced, the others as set
        (a ``PerReplica`` from ``strategy.run``, for instance)."""
        return dict(self._last_step_outputs)

    @property
    def non_tensor_outputs(self) -> dict[str, Any]:
        """The non-tensor outputs by name (from replica context: one value per replica)."""
        return dict(self._non_tensor_outputs)

    async def set_last_step_output(
        self, name: str, output: Any, reduce_op: ReduceOp | str | None = None
    ) -> None:
        """Record ``output`` under ``name``, reduced over the replicas with ``reduce_op``.

        Awaitable, unlike TF's, because a reduction is.

        Args:
            name: the output's name.
            output: in cross-replica context, a value or a ``PerReplica`` (from
                ``strategy.run``); in a replica, this replica's value.
            reduce_op: how to combine the replicas' values; ``None`` keeps ``output`` as it
                is (cross-replica context, or outside any strategy, only).

        Raises:
            TypeError: ``name`` is not a ``str``.
            ValueError: ``reduce_op`` is ``None`` in replica context (TF requires one there).

        Example:
            >>> async def record():
            ...     context = MultiStepContext()
            ...     await context.set_last_step_output("step", 3)
            ...     return context.last_step_outputs
            >>> anyio.run(record)
            {'step': 3}
        """
        _check_name("set_last_step_output()", name)
        context = get_replica_context()
        if context is None or context is default_replica_context():  # one replica, or none
            strategy = _strategy()
            self._last_step_outputs[name] = (
                output if reduce_op is None else await strategy.reduce(reduce_op, output)
            )
            self._reduce_ops[name] = reduce_op
            return
        if reduce_op is None:
            raise ValueError(
                f"set_last_step_output({name!r}) in replica context needs a reduce_op to "
                "combine the replicas' values; pass one, or set it in cross-replica context"
            )

        async def record(strategy: Any, value: Any) -> None:
            self._last_step_outputs[name] = await strategy.reduce(reduce_op, value)
            self._reduce_ops[name] = reduce_op

        await context.merge_call(record, args=(output,))

    async def set_non_tensor_output(self, name: str, output: Any) -> None:
        """Record ``output`` under ``name`` without reducing it.

        In replica context every replica's value is kept: the output is the tuple of them,
        or, where every replica passed the very same object, a 1-tuple of it, as in TF (a
        list, tuple or dict is rebuilt around its leaves, as TF's regrouping does: a 1-tuple
        of an equal one where every replica passed the same leaves).

        Raises:
            TypeError: ``name`` is not a ``str``.

        Example:
            >>> async def record():
            ...     context = MultiStepContext()
            ...     await context.set_non_tensor_output("note", "done")
            ...     return context.non_tensor_outputs
            >>> anyio.run(record)
            {'note': 'done'}
        """
        _check_name("set_non_tensor_output()", name)
        context = get_replica_context()
        if context is None or context is default_replica_context():
            self._non_tensor_outputs[name] = output
            return

        def record(strategy: Any, value: Any) -> None:
            # TF's local results: a value in which every replica passed the same objects (the
            # regrouping collapsed them: no per-replica part is left) is one value.
            leaves, _ = _tree.flatten(value)
            one = not any(isinstance(leaf, DistributedValues) for leaf in leaves)
            local = (value,) if one else strategy.experimental_local_results(value)
            self._non_tensor_outputs[name] = local

        await context.merge_call(record, args=(output,))


def _check_name(what: str, name: object) -> None:
    """Refuse an output name that is not a string (the outputs are looked up by name).

    Raises:
        TypeError: ``name`` is not a ``str``.
    """
    if not isinstance(name, str):
        raise TypeError(
            f"{what} takes an output name as a str, got {type(name).__name__} {name!r:.60}; "
            "name the output with a string, such as 'loss'"
        )


def _strategy() -> Any:
    """The strategy whose cross-replica context this is (the default one outside any)."""
    state = context_state.get()
    return state.strategy if state.strategy is not None else default_replica_context().strategy


async def run_steps_on_iterator(
    strategy: Any,
    fn: Callable[[MultiStepContext, Any], Any],
    iterator: Any,
    iterations: int,
    initial_loop_values: Mapping[str, Any] | None,
) -> MultiStepContext:
    """``extended.experimental_run_steps_on_iterator``: see its docstring."""
    what = "experimental_run_steps_on_iterator()"

    def checked() -> tuple[AsyncIterator[Any], int]:
        if not callable(fn):
            raise TypeError(f"{what} needs a callable fn, got {type(fn).__name__}")
        if initial_loop_values is not None and not isinstance(initial_loop_values, Mapping):
            raise TypeError(
                f"{what} takes initial_loop_values as a mapping of output names to values (a "
                "dict, such as {'loss': 0.0}: the last_step_outputs before the first step) or "
                f"None, got {type(initial_loop_values).__name__} {initial_loop_values!r:.60}"
            )
        for name in initial_loop_values or {}:
            _check_name(f"{what}'s initial_loop_values", name)
        return _check_iterator(iterator, what), _check_steps(iterations, "iterations")

    feed, count = await strategy._accepted(what, checked, "iterations")
    context = MultiStepContext()
    context._last_step_outputs.update(initial_loop_values or {})
    for _ in range(count):
        try:
            inputs = await anext(feed)
        except StopAsyncIteration:
            break
        with strategy.scope():  # fn runs in this strategy's cross-replica context
            result = fn(context, inputs)
            if inspect.isawaitable(result):
                await result
            elif made_by_yield(fn, result):
                raise yielding_step(f"{what}'s fn", result)
    return context
