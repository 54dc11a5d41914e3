"""Every exception aioreplica raises of its own, and what its messages and argument checks share.

Each class subclasses the nearest builtin, so ``except RuntimeError:`` in existing code keeps
working, and builds its message from fields that tests and callers can read.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import numbers
import operator
import types
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "AioreplicaInternalError",
    "CheckpointError",
    "ClusterBroken",
    "ReplicaSyncError",
    "WorkersDisagree",
    "add_note",
    "as_integer",
    "as_real",
    "checked_integer",
    "made_by_yield",
    "replica_list",
    "yielding_step",
]


def as_integer(value: object) -> int | None:
    """``value`` as a Python int if it is an integer, else ``None``: for the checks of integer
    arguments, which take NumPy's integers as NumPy does, and refuse a bool as one.

    >>> as_integer(3), as_integer(np.int64(3)), as_integer(True), as_integer(3.0)
    (3, 3, None, None)
    """
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def checked_integer(value: object, requirement: str, low: int, high: int | None = None) -> int:
    """``value`` as a Python int from ``low`` to ``high`` (no bound: ``None``), or an error
    that states ``requirement`` (such as ``"batch_size must be an int >= 1"``) and names
    ``value``: a wrong type is a TypeError, a wrong integer a ValueError.

    Raises:
        TypeError: ``value`` is not an integer (a bool is not one, nor a float or a string).
        ValueError: it is an integer out of range.

    >>> checked_integer(np.int64(2), "n must be an int >= 1", 1)
    2
    >>> checked_integer(True, "n must be an int >= 1", 1)
    Traceback (most recent call last):
    TypeError: n must be an int >= 1, got bool True
    """
    number = as_integer(value)
    if number is None:
        raise TypeError(f"{requirement}, got {type(value).__name__} {value!r:.60}")
    if number < low or (high is not None and number > high):
        raise ValueError(f"{requirement}, got {value!r:.60}")
    return number


def as_real(value: object) -> float | None:
    """``value`` as a float if it is a real number, else ``None``: for the checks of arguments
    in seconds, which take NumPy's numbers too, and refuse a bool as one. An integer too large
    for a float is infinite, which those checks refuse as not finite.

    >>> as_real(2), as_real(np.float32(0.5)), as_real(True), as_real("2"), as_real(10**400)
    (2.0, 0.5, None, None, inf)
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # (only an int can be too large)
        return math.inf


#: The range of int64, the dtype NumPy gives Python ints, which collectives, variables and
#: checkpoints refuse beyond it (plain ints: ``np.iinfo``'s are slow to read).
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1


def yielding_step(
    step: str,
    generator: types.AsyncGeneratorType[Any, Any] | types.GeneratorType[Any, Any, Any],
    kind: str = "a step function",
) -> TypeError:
    """The error for a step function (``step``: which one; ``kind``: what it is) with a
    ``yield``: calling it made ``generator``, and none of its code ran."""
    what = "an async generator" if type(generator) is types.AsyncGeneratorType else "a generator"
    if type(generator) is types.GeneratorType:
        generator.close()  # never started: closing it runs none of its code
    return TypeError(
        f"{step} is {what} function ({generator.__qualname__}: it contains `yield`), so none "
        f"of its code ran; {kind} returns its result: write `return`"
    )


def made_by_yield(fn: Callable[..., Any], result: object) -> bool:
    """Whether ``result`` shows that ``fn`` contains ``yield``, so that calling it ran none of
    its code: an async generator, or the generator that calling ``fn`` made, rather than one
    ``fn`` built and returned (a generator expression, say), which is a result like any
    other. Looked through ``functools.partial``, bound methods, ``functools.wraps`` and a
    callable object's ``__call__``, only for a result that is a generator.

    >>> def counting():
    ...     yield 1
    >>> made_by_yield(counting, counting()), made_by_yield(lambda: (i for i in []), counting())
    (True, False)
    """
    if type(result) is types.AsyncGeneratorType:
        return True
    if type(result) is not types.GeneratorType:
        return False
    inner: Any = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    with contextlib.suppress(ValueError):  # a cycle of __wrapped__: look no further
        inner = inspect.unwrap(inner)
    code = getattr(getattr(inner, "__func__", inner), "__code__", None)
    if code is None:  # a callable object: its class's __call__
        code = getattr(inspect.getattr_static(inner, "__call__", None), "__code__", None)
    return result.gi_code is code


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, unless the exception's own code made ``__notes__`` something
    other than a list: it is raised as it is then, not replaced by ``add_note``'s TypeError.

    >>> error = ValueError("x")
    >>> error.__notes__ = ("its own",)
    >>> add_note(error, "more"); error.__notes__
    ('its own',)
    """
    with contextlib.suppress(TypeError):
        exc.add_note(note)


def replica_list(ids: Sequence[int]) -> str:
    """Format replica ids for a message, e.g. ``replicas 0, 1 and 3``."""
    ids = sorted(ids)
    if len(ids) == 1:
        return f"replica {ids[0]}"
    if len(ids) > 12:
        head = ", ".join(map(str, ids[:10]))
        return f"replicas {head}, ... ({len(ids)} in all)"
    return "replicas " + ", ".join(map(str, ids[:-1])) + f" and {ids[-1]}"


class ReplicaSyncError(RuntimeError):
    """Replicas stopped agreeing on their ``merge_call`` sequence, or one left the others waiting.

    Raised out of ``MirroredStrategy.run()`` after every replica has been cancelled, never
    from inside a replica.

    Attributes:
        merge_number: the 1-based number of the ``merge_call`` round where it went wrong
            (``None`` only while it is raised inside a merge function: the scheduler sets it).
        replicas: the replicas at fault (those that finished early, differ, or are late;
            global ids on a multi-worker strategy).
        waiting: the replicas that were waiting at that merge point.
        workers: on a multi-worker strategy, the workers at fault (that failed, or are late);
            empty otherwise.
    """

    def __init__(
        self,
        message: str,
        *,
        merge_number: int | None,
        replicas: Iterable[int] = (),
        waiting: Iterable[int] = (),
        workers: Iterable[int] = (),
    ) -> None:
        super().__init__(message)
        self.merge_number = merge_number
        self.replicas = tuple(sorted(replicas))
        self.waiting = tuple(sorted(waiting))
        self.workers = tuple(sorted(workers))


class ClusterBroken(RuntimeError):
    """A ``MultiWorkerMirroredStrategy`` refuses a call because its workers fell out of step.

    After a cross-worker failure (a worker's replica raised, a worker was late past
    ``sync_timeout``, a ``run()`` was cancelled on one worker), MPI cannot take back the
    collectives under way, so the strategy makes no more cross-worker calls: every later call
    raises this, naming the failure. End the job (or handle the failure and start a new one).
    The failure itself is raised once, as a ``ReplicaSyncError`` on the workers that did not
    fail; this is what the calls after it raise.
    """


class WorkersDisagree(ValueError):
    """The workers of a ``MultiWorkerMirroredStrategy`` made different collectives, or passed
    one collective values of other shapes, dtypes or ops, or one worker refused its arguments.

    Found from what every worker sent, so raised alike on every worker before any data moved:
    the workers stay in step, and the strategy remains usable. Unless some workers made the
    collective in a ``run()`` and others outside one (a call made on some workers only): their
    programs then stand at different points, and the strategy is broken on every worker alike
    (``ClusterBroken`` afterwards).

    Attributes:
        said: what each worker said its collective was, by worker (empty when not known).
        workers: the workers that refused their arguments, if any did.
    """

    def __init__(self, message: str, *, said: Sequence[str] = (), workers: Sequence[int] = ()):
        super().__init__(message)
        self.said = tuple(said)
        self.workers = tuple(workers)


class CheckpointError(ValueError):
    """A checkpoint file cannot be restored: corrupted, truncated, or not matching the objects.

    Raised before anything is changed: every object keeps its value.

    Attributes:
        path: the checkpoint file.
        problems: one line per problem, each naming the object (``model/w``) it concerns.
    """

    def __init__(self, path: str, problems: Sequence[str]) -> None:
        self.path = path
        self.problems = tuple(problems)
        shown = "; ".join(self.problems[:8])
        more = f"; and {len(self.problems) - 8} more" if len(self.problems) > 8 else ""
        super().__init__(f"cannot restore checkpoint {path!r}: {shown}{more}")


class AioreplicaInternalError(RuntimeError):
    """aioreplica broke one of its own invariants: this is a bug in aioreplica, not in your code.

    Please report it with the traceback; the message says which invariant failed.
    """

    def __init__(self, message: str) -> None:
        super().__init__(
            f"{message}\nThis is a bug in aioreplica, not in your code; please report it with "
            "this traceback."
        )
