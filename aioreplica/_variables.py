"""Distributed variables: state with one copy per replica that stays in sync.

``Variable(...)`` inside ``with strategy.scope():`` makes a ``MirroredVariable`` (every copy
always equal; writes from replicas are aggregated and applied to every copy in one merge round)
or a ``SyncOnReadVariable`` (each replica writes its own copy; a cross-replica read aggregates
them). Anywhere else it makes an ordinary single-copy variable.

Writes are all-or-nothing: every copy's new array is computed first, then all are swapped in
at once (``aioreplica._writes``, the write engine that optimizers and checkpoints share). A
mirrored variable's replica-context write aggregates the replicas' values on its strategy's
reduction engine, which the variable keeps from the scope it was made in.

Reads follow the context (see ``aioreplica._context``): in replica context the replica's own
copy; in cross-replica context a mirrored variable's primary copy (replica 0's) and a
sync-on-read variable's aggregate.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, Literal, NoReturn, final, overload

import anyio
import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from ._backends import array_module, host_array, host_device, is_array, is_cupy_array
from ._backends._arrays import on_replica_devices
from ._cluster import WorkersDisagree, call_of, error_line, in_native_order, raw_bytes
from ._collectives import reductions_for, register_copied_type
from ._context import (
    MERGE_CALLS,
    ContextState,
    ReplicaContext,
    context_state,
    default_replica_context,
    default_scope_open,
    other_strategy,
)
from ._errors import INT64_MAX, INT64_MIN, ReplicaSyncError, add_note, replica_list
from ._options import CaseInsensitiveStrEnum, ReduceOp
from ._tree import flatten_with_path, format_path, short_repr
from ._values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    agreed,
    out_argument,
    select_replica,
    writes_first_argument,
)
from ._writes import (
    ADD,
    ASSIGN,
    SUB,
    Turn,
    active,
    commit,
    compute_copies,
    compute_update,
    frozen,
    share_writer,
    to_host,
    writer,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from ._backends import Device
    from ._cluster import Workers
    from ._collectives import ReductionEngine

__all__ = [
    "AcrossWorkers",
    "Aggregate",
    "MirroredVariable",
    "SyncOnReadVariable",
    "Variable",
    "VariableAggregation",
    "VariableRef",
    "VariableSynchronization",
    "bits_differ",
    "check_updated_by",
    "filled_slot_variable",
    "host_value",
    "new_copies",
    "slot_variable",
    "snapshot",
    "update",
    "variable_label",
    "which_differ",
]


class VariableSynchronization(CaseInsensitiveStrEnum):
    """When the copies of a distributed variable are brought in sync. Strings are accepted.

    ``AUTO`` and ``ON_WRITE`` make a ``MirroredVariable`` (synced on every write); ``ON_READ``
    a ``SyncOnReadVariable`` (copies differ; aggregated when read in cross-replica context);
    ``NONE`` is only for ordinary variables made outside any strategy scope.

    Example:
        >>> VariableSynchronization.parse("on_read")
        <VariableSynchronization.ON_READ: 'on_read'>
    """

    AUTO = "auto"
    ON_WRITE = "on_write"
    ON_READ = "on_read"
    NONE = "none"


class VariableAggregation(CaseInsensitiveStrEnum):
    """How the replicas' values combine into one. Strings are accepted.

    For a ``MirroredVariable`` it is how the values that replicas write in one merge round
    combine (``NONE``: writing from replica context is an error); for a ``SyncOnReadVariable``
    how its copies combine when it is read in cross-replica context.

    Example:
        >>> VariableAggregation.parse("MEAN")
        <VariableAggregation.MEAN: 'mean'>
    """

    NONE = "none"
    SUM = "sum"
    MEAN = "mean"
    ONLY_FIRST_REPLICA = "only_first_replica"


_Sync = VariableSynchronization
_Agg = VariableAggregation


def _sync_of(value: VariableSynchronization | str | None) -> VariableSynchronization:
    """``synchronization`` as a member; ``None`` is the default, ``AUTO``, as in TF."""
    return _Sync.AUTO if value is None else _Sync.parse(value)


def _agg_of(value: VariableAggregation | str | None) -> VariableAggregation:
    """``aggregation`` as a member; ``None`` is the default, ``NONE``, as in TF."""
    return _Agg.NONE if value is None else _Agg.parse(value)


class Variable(NDArrayOperatorsMixin):
    """State that keeps its value between steps; one copy per replica under a strategy.

    Inside ``with strategy.scope():`` the constructor returns a ``MirroredVariable``
    (``synchronization`` ``AUTO`` or ``ON_WRITE``) or a ``SyncOnReadVariable`` (``ON_READ``),
    with one copy on each replica's device, all starting equal. Anywhere else it returns an
    ordinary variable with one copy on the host.

    Inside a replica of ``strategy.run`` the replicas share their variables, as in TF: each
    replica's ``k``-th ``Variable(...)`` call in a run returns the same variable, of the
    replica's strategy, made from the arguments of the first replica to get there. Pass the
    same initial value on every replica (TF takes replica 0's).

    A variable reads like an array: ``v.value()``, ``np.asarray(v)``, ``v + 1``, ``x @ v`` and
    ``v[0]`` use the current replica's copy in replica context (see the subclasses for
    cross-replica context). It is written only through ``await v.assign(x)``,
    ``assign_add`` and ``assign_sub``, never in place: ``value()`` arrays are read-only on the
    host, and NumPy calls that would write into a variable (``out=v``, ``np.copyto(v, x)``,
    ``np.add.at(v, i, x)``) raise ``TypeError``. As with TensorFlow variables and NumPy arrays,
    ``==`` is elementwise, so variables are not hashable. As in TF, ``copy.copy(v)`` is ``v``
    and ``copy.deepcopy(v)`` a new variable; a variable cannot be pickled (pickle
    ``v.numpy()``, or save a ``Checkpoint``).

    Args:
        initial_value: an array-like, or a callable returning one (called once).
        trainable: whether optimizers should train it (recorded, as in TF); by default
            ``True``, except with ``synchronization="on_read"`` (``False``, as in TF). The
            second positional argument, as in TF; the others are keyword-only.
        name: a name for messages and reprs; default ``"Variable"``.
        dtype: the dtype to store; default: ``initial_value``'s (Python floats: float64).
            The initial value is cast to it as a write would be: an array of another kind of
            number (a float array to an integer dtype, say) is refused; Python numbers take
            it where they fit (an int takes an integer, float or complex dtype, and bool as
            ``0`` or ``1``; a float takes a float or complex dtype).
        synchronization: a ``VariableSynchronization`` or its name; ``None`` means ``AUTO``.
        aggregation: a ``VariableAggregation`` or its name; ``None`` means ``NONE``.
        shape: the shape, checked against the initial value's (a variable's shape never
            changes, so TF's partly unknown shapes have no use here); ``None``: the initial
            value's.

    Raises:
        ValueError: an invalid ``synchronization`` or ``aggregation`` (the message lists the
            valid ones); ``synchronization="none"`` inside a strategy scope; an integer of
            ``initial_value`` that ``dtype`` cannot hold (a cast would wrap it around), or,
            with no ``dtype``, a Python int beyond int64 (pass ``dtype="uint64"`` for one up to
            ``2**64 - 1``), and any beyond uint64; ``shape`` differs from the initial value's.
        TypeError: ``initial_value`` is not numeric or bool; ``dtype`` is not a numeric or
            bool NumPy dtype, or ``initial_value`` does not cast to it without losing its kind
            of number (a float to an integer, a complex to a float, a bool to any other
            dtype); a sync-on-read variable with ``aggregation="mean"`` and a dtype that
            cannot be averaged (integers, bool);
            ``name`` is not a string, ``trainable`` not a bool, or ``shape`` not ints.
        RuntimeError: inside a replica, this replica's ``k``-th variable differs in name,
            class, synchronization, aggregation, dtype, ``trainable`` or initial shape from
            the one another replica made as its ``k``-th (every replica must make the same
            variables in the same order); inside a replica of a ``MultiWorkerMirroredStrategy``
            (make them in its scope, outside ``run()``, where every worker starts them from the
            chief's value).

    Example:
        >>> v = Variable(np.zeros(3), name="bias")
        >>> v
        <aioreplica.Variable 'bias' shape=(3,) dtype=float64 value=array([0., 0., 0.])>
        >>> anyio.run(v.assign_add, 1.0)
        <aioreplica.Variable 'bias' shape=(3,) dtype=float64 value=array([1., 1., 1.])>
        >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> with strategy.scope():
        ...     w = Variable(np.ones(2), name="w")
        >>> type(w).__name__, len(w.values)
        ('MirroredVariable', 2)
        >>> Variable(np.zeros(2), False, shape=(2,)).trainable
        False
    """

    __slots__ = (
        "__weakref__",
        "_aggregation",
        "_copies",
        "_devices",
        "_dtype",
        "_engine",
        "_name",
        "_number",
        "_shape",
        "_strategy",
        "_synchronization",
        "_trainable",
        "_turn",
        "_unsynced",
    )

    def __hash__(self) -> int:
        # Elementwise ``==`` (from the operator mixin) rules out a consistent hash.
        raise TypeError(
            f"unhashable type: {type(self).__name__!r} ({self._name!r}): == is elementwise; "
            "use v.ref() as a dict key or set member, as in TF"
        )

    def ref(self) -> VariableRef:
        """A hashable reference to this variable, for dict keys and sets (TF's ``ref()``):
        references to one variable are equal; ``deref()`` gives the variable back.

        Example:
            >>> v = Variable(1.0)
            >>> {v.ref(): "weight"}[v.ref()], v.ref().deref() is v
            ('weight', True)
        """
        return VariableRef(self)

    def __new__(cls, *args: Any, **kwargs: Any) -> Variable:
        replica = context_state.get().replica
        if replica is not None:  # the replicas share their variables; __init__ then returns
            shared: Variable = _shared(cls, replica, args, kwargs)
            return shared
        # ``Variable(...)`` picks its class from the context, as ``tf.Variable`` does; the
        # subclasses' own constructors check the context instead.
        if cls is Variable and _scope(kwargs.get("name") or "Variable")[0] is not None:
            sync = _sync_of(kwargs.get("synchronization"))
            cls = SyncOnReadVariable if sync is _Sync.ON_READ else MirroredVariable
        return object.__new__(cls)

    def __init__(
        self,
        initial_value: Any,
        trainable: bool | None = None,
        *,
        name: str | None = None,
        dtype: Any = None,
        synchronization: VariableSynchronization | str | None = "auto",
        aggregation: VariableAggregation | str | None = "none",
        shape: Sequence[int] | int | None = None,
    ) -> None:
        if context_state.get().replica is not None:
            return  # ``__new__`` has returned the replicas' shared variable, made already
        sync = _sync_of(synchronization)
        agg = _agg_of(aggregation)
        if name is None:
            name = "Variable"
        if not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {type(name).__name__}")
        if trainable is not None and not isinstance(trainable, bool | np.bool_):
            raise TypeError(f"trainable must be True, False or None, got {trainable!r}")
        strategy, engine = _scope(name)
        _check_kind(type(self), strategy, sync, agg, name)
        value = initial_value() if callable(initial_value) else initial_value
        if trainable is None:
            trainable = sync is not _Sync.ON_READ
        self._init(strategy, engine, value, name, dtype, bool(trainable), sync, agg, shape)
        workers = engine.cluster if engine is not None else None
        if workers is not None:  # it starts from the chief's value, fetched before first use
            self._unsynced = True
            workers.pending.append(self)
            self._number: int | None = workers.variables_made
            workers.variables_made += 1

    def _init(
        self,
        strategy: Any,
        engine: ReductionEngine | None,
        value: Any,
        name: str,
        dtype: Any,
        trainable: bool,
        sync: VariableSynchronization,
        agg: VariableAggregation,
        shape: Sequence[int] | int | None = None,
    ) -> None:
        array = _initial_array(value, dtype, name)
        if shape is not None:
            _check_shape(shape, tuple(array.shape), name)
        _check_aggregation_dtype(agg, array.dtype, name, sync is _Sync.ON_READ)
        self._describe(strategy, engine, name, array.dtype, array.shape, trainable, sync, agg)
        self._copies: tuple[Any, ...] = tuple(
            frozen(device.asarray(array)) for device in self._devices
        )

    def _describe(
        self,
        strategy: Any,
        engine: ReductionEngine | None,
        name: str,
        dtype: Any,
        shape: Sequence[int],
        trainable: bool,
        sync: VariableSynchronization,
        agg: VariableAggregation,
    ) -> None:
        """Set every fact of a new variable but its copies, which the caller makes."""
        self._strategy = strategy
        self._engine = engine
        self._turn = Turn()  # writes take it in turn (invariant 8)
        self._devices: tuple[Device, ...] = (
            engine.devices if engine is not None else (host_device(0),)
        )
        self._name = name
        self._dtype: np.dtype[Any] = np.dtype(dtype)
        self._shape: tuple[int, ...] = tuple(int(d) for d in shape)
        self._trainable = trainable
        self._synchronization = sync
        self._aggregation = agg
        self._unsynced = False
        #: Across workers, the variable's number among those made on the communicator (the
        #: same on every worker, which compare it: ``variable_label``); else ``None``, as for
        #: slots.
        self._number = None

    # -- facts ----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The variable's name."""
        return self._name

    @property
    def dtype(self) -> np.dtype[Any]:
        """The NumPy dtype of every copy."""
        return self._dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of every copy."""
        return self._shape

    def get_shape(self) -> tuple[int, ...]:
        """``shape`` (TF's spelling).

        Example:
            >>> Variable([1.0, 2.0]).get_shape()
            (2,)
        """
        return self._shape

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return len(self._shape)

    @property
    def size(self) -> int:
        """The number of elements."""
        return int(np.prod(self._shape))

    @property
    def trainable(self) -> bool:
        """Whether optimizers should train it."""
        return self._trainable

    @property
    def synchronization(self) -> VariableSynchronization:
        """How its copies are kept in sync (``AUTO`` for ordinary variables unless given)."""
        return self._synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        """How replicas' values combine."""
        return self._aggregation

    @property
    def distribute_strategy(self) -> Any:
        """The strategy whose scope created it; ``None`` for an ordinary variable."""
        return self._strategy

    @property
    def devices(self) -> tuple[str, ...]:
        """The device of each copy, in replica order."""
        return tuple(device.name for device in self._devices)

    @property
    def device(self) -> str:
        """The device of the copy the current context reads: a replica's own, else the first
        (TF's primary).

        Raises:
            RuntimeError: read inside a replica of another strategy.
        """
        replica = context_state.get().replica
        if replica is not None and self._strategy is not None:
            return self._devices[self._replica_id(replica, "read the device of")].name
        return self._devices[0].name

    @property
    def values(self) -> tuple[Any, ...]:
        """The copies, one per replica (host replicas may share one read-only array).

        Across workers, this worker's copies. Reading them is a read like ``value()``: a
        variable not used yet takes the chief's value first, so every worker must read it.

        Raises:
            RuntimeError: across workers, a first read while another cross-worker call or
                collective is in progress on this worker; a worker failed or was late
                (``ReplicaSyncError``); the cluster is broken (``ClusterBroken``).
            ValueError: across workers, a first read of variables made in another order,
                or of another kind, dtype or shape, on another worker (``WorkersDisagree``).

        Example:
            >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with strategy.scope():
            ...     w = Variable([1.0, 2.0], name="w")
            >>> [copy.tolist() for copy in w.values]
            [[1.0, 2.0], [1.0, 2.0]]
        """
        if self._unsynced:  # this worker's own initial value until then, not the variable's
            sync_variables_now(self._engine)
        return self._copies

    # -- reads ----------------------------------------------------------------------------

    def value(self) -> Any:
        """The value in the current context: this replica's copy, else the cross-replica read.

        Returns:
            An array on the replica's device (read-only on the host).

        Raises:
            RuntimeError: read inside a replica of another strategy.

        Example:
            >>> Variable(2.5).value()
            array(2.5)
        """
        return self._read()[0]

    def _read(self) -> tuple[Any, Device]:
        """``value()`` and the device whose stream made it."""
        if self._unsynced:
            sync_variables_now(self._engine)
        replica = context_state.get().replica
        if replica is not None and self._strategy is not None:
            index = self._replica_id(replica, "read")
            return self._copies[index], self._devices[index]
        return self._read_cross_replica(), self._devices[0]

    def _host(self) -> np.ndarray[Any, Any]:
        """``value()`` on the host: a GPU value copied on its device's stream, after the work
        that made it (blocking the thread until then)."""
        value, device = self._read()
        return host_array(value, device)

    def read_value(self) -> Any:
        """The same as ``value()`` (TF's spelling).

        Raises:
            RuntimeError: as ``value()``.

        Example:
            >>> Variable([1, 2]).read_value()
            array([1, 2])
        """
        return self.value()

    def numpy(self) -> np.ndarray[Any, Any]:
        """A writeable host (NumPy) copy of ``value()``.

        For a GPU copy this waits for the device, blocking the thread: in async code prefer
        ``await device.run(...)`` or a checkpoint.

        Raises:
            RuntimeError: as ``value()``.

        Example:
            >>> Variable([1.0]).numpy().flags.writeable
            True
        """
        value, device = self._read()
        if is_cupy_array(value):
            return host_array(value, device)
        return np.array(value, copy=True)

    def _read_cross_replica(self) -> Any:
        return self._copies[0]

    def _replica_id(self, replica: ReplicaContext, what: str) -> int:
        """The copy that ``replica`` owns; ``RuntimeError`` if it is another strategy's."""
        if replica.strategy is not self._strategy:
            raise RuntimeError(
                f"variable {self._name!r} was created in the scope of {self._strategy!r}, but "
                f"replica {replica.replica_id_in_sync_group} of {replica.strategy!r} tried to "
                f"{what} it; use each variable only with the strategy that created it"
            )
        return replica.local_replica_id

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        value, device = self._read()
        if is_cupy_array(value):
            if copy is False:
                raise ValueError(
                    f"variable {self._name!r} lives on a GPU; NumPy needs a copy of it"
                )
            value = host_array(value, device)
        result: np.ndarray[Any, Any] = value
        if dtype is not None and np.dtype(dtype) != value.dtype:
            if copy is False:  # NumPy 2's copy=False: never a copy, else a ValueError
                raise ValueError(
                    f"variable {self._name!r} has dtype {value.dtype}, so NumPy needs a copy "
                    f"of it for dtype {np.dtype(dtype)}, which copy=False refuses; leave "
                    "copy out (a copy where needed), or pass copy=True"
                )
            return result.astype(dtype)
        return result.copy() if copy else result

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        _check_out(kwargs.get("out"), ufunc)
        if method == "at" and isinstance(inputs[0], Variable):
            # ufunc.at writes into its first operand even where it is read-only.
            inputs[0]._refuse_in_place(f"{ufunc.__name__}.at")
        args = [x.value() if isinstance(x, Variable) else x for x in inputs]
        return getattr(ufunc, method)(*args, **kwargs)

    def __array_function__(
        self, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A NumPy function of the variable's value, as NumPy computes it without this
        method (the variable converts through ``__array__``); refused where it would write
        into a variable (``np.copyto(v, x)``, ``np.put(v, i, x)``, an ``out`` argument)."""
        out = out_argument(func, args, kwargs)
        if out is not None:
            _check_out(out, func)
        first = args[0] if args else None
        if isinstance(first, Variable) and writes_first_argument(func, args, kwargs):
            first._refuse_in_place(func.__name__)
        for kind in types:  # (a loop: every NumPy call on a variable comes here)
            if not issubclass(kind, _COMPUTED_HERE):
                return NotImplemented  # the other types' own (a Mirrored's, a CuPy array's) decide
        return func._implementation(*args, **kwargs)

    def _refuse_in_place(self, what: str) -> NoReturn:
        """Refuse a NumPy function or ufunc method (``what``) that writes into the variable.

        Raises:
            TypeError: always, naming the variable and how to write it.
        """
        raise TypeError(
            f"variable {self._name!r} cannot be written in place by {what}; variables change "
            "only through `await v.assign(...)`, `assign_add` or `assign_sub`, every copy or "
            f"none: compute the new value on a copy (x = v.numpy(); np.{what}(x, ...)) and "
            "`await v.assign(x)`"
        )

    def __getitem__(self, key: Any) -> Any:
        return self.value()[key]

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError(f"len() of the 0-d variable {self._name!r}")
        return self._shape[0]

    def __iter__(self) -> Iterator[Any]:
        # Without it Python would iterate through __getitem__, and a 0-d one would seem empty.
        if not self._shape:
            raise TypeError(f"iteration over the 0-d variable {self._name!r}")
        return iter(self.value())

    def __bool__(self) -> bool:
        return bool(self._host())

    def __float__(self) -> float:
        return float(self._host())

    def __int__(self) -> int:
        return int(self._host())

    def __format__(self, spec: str) -> str:
        """``f"{loss:.4f}"``: its value formatted as NumPy formats it (a 0-d variable as a
        number; one of more dimensions refuses a spec, as a NumPy array does); with no spec,
        ``str(v)``."""
        if not spec:
            return str(self)
        return format(self._host(), spec)

    def __index__(self) -> int:
        """A 0-d integer variable as an index (``range(v)``, ``save(checkpoint_number=v)``),
        as NumPy's 0-d integer arrays and TF's integer variables are.

        Raises:
            TypeError: the variable is not 0-d, or not of an integer dtype.
        """
        if self._shape or self._dtype.kind not in "iu":
            raise TypeError(
                f"variable {self._name!r} of shape {self._shape} and dtype {self._dtype} is no "
                "index: only a 0-d integer variable is"
            )
        return int(self._host())

    def __copy__(self) -> Variable:
        """The variable itself, as TF's ``copy.copy`` of a variable: a shallow copy would share
        the copies and the write turn while its later writes stayed its own.

        Example:
            >>> import copy
            >>> v = Variable(np.zeros(2), name="w")
            >>> copy.copy(v) is v
            True
        """
        return self

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        """Refused: a variable cannot be pickled. Its copies live on its devices (a distributed
        variable's with its strategy) and take their writes in turn there, none of which
        travels to another process.

        Raises:
            TypeError: always, naming the variable and what to save instead.

        Example:
            >>> import pickle
            >>> pickle.dumps(Variable(np.zeros(2), name="w"))  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            TypeError: cannot pickle variable 'w' (Variable): ...
        """
        raise TypeError(
            f"cannot pickle variable {self._name!r} ({type(self).__name__}): a variable lives "
            "on its devices (a distributed one with its strategy) and takes its writes in turn "
            "there, which does not travel between processes; pickle its value (v.numpy()) "
            "and make a new Variable of it where it is loaded, or save variables with "
            "aioreplica.Checkpoint"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Variable:
        """A new variable of the same kind, strategy and devices, holding copies of the values.

        The strategy (and its devices) is shared, not copied: a variable belongs to it.

        Example:
            >>> import copy
            >>> v = Variable(np.zeros(2), name="w")
            >>> w = copy.deepcopy(v)
            >>> anyio.run(w.assign, 1.0).numpy(), v.numpy()
            (array([1., 1.]), array([0., 0.]))
        """
        new = object.__new__(type(self))
        for name in (
            "_aggregation",
            "_devices",
            "_dtype",
            "_engine",
            "_name",
            "_shape",
        ):
            setattr(new, name, getattr(self, name))
        new._strategy = self._strategy
        new._synchronization = self._synchronization
        new._trainable = self._trainable
        new._turn = Turn()
        new._unsynced = self._unsynced
        new._number = None
        if self._number is not None:  # a new variable of every worker's, numbered alike
            workers = self._engine.cluster  # type: ignore[union-attr]
            assert workers is not None
            new._number = workers.variables_made
            workers.variables_made += 1
        if self._unsynced:  # still to take the chief's value: in turn with the others
            self._engine.cluster.pending.append(new)  # type: ignore[union-attr]
        fresh: dict[int, Any] = {}  # host replicas share one array: copy it once
        for copy, device in zip(self._copies, self._devices, strict=True):
            if id(copy) not in fresh:
                with active(device):
                    fresh[id(copy)] = frozen(array_module(copy).array(copy, copy=True))
        new._copies = tuple(fresh[id(copy)] for copy in self._copies)
        memo[id(self)] = new
        return new

    def __repr__(self) -> str:
        try:
            shown = self._shown_pending() if self._unsynced else self._shown()
        except Exception:  # a repr must not raise
            shown = "<unreadable>"
            if isinstance(self, SyncOnReadVariable) and self._aggregation is _Agg.NONE:
                shown = "<one per replica: aggregation NONE>"
        return (
            f"<aioreplica.{type(self).__name__} {self._name!r} shape={self._shape} "
            f"dtype={self._dtype}{self._placement()} value={shown}>"
        )

    def _shown(self) -> str:
        """The value a repr shows (its cross-replica read)."""
        return repr(host_array(self._read_cross_replica(), self._devices[0]))

    def _shown_pending(self) -> str:
        """What a repr shows of a variable across workers before its first read or write:
        this worker's copies, named as such. Taking the chief's value is a collective, which a
        repr (a log line on the chief alone, say) must not make."""
        copies = ", ".join(
            repr(host_array(c, d)) for c, d in zip(self._copies, self._devices, strict=True)
        )
        return f"<takes the chief's value when first used; this worker's copies: {copies}>"

    def _placement(self) -> str:
        if self._strategy is None:
            return ""
        return f" devices={list(self.devices)}"

    # -- writes ---------------------------------------------------------------------------

    @overload
    async def assign(
        self,
        value: Any,
        use_locking: bool | None = ...,
        name: str | None = ...,
        read_value: Literal[True] = ...,
    ) -> Variable: ...
    @overload
    async def assign(
        self,
        value: Any,
        use_locking: bool | None = ...,
        name: str | None = ...,
        read_value: bool = ...,
    ) -> Variable | None: ...
    async def assign(
        self,
        value: Any,
        use_locking: bool | None = None,
        name: str | None = None,
        read_value: bool = True,
    ) -> Variable | None:
        """Set the variable to ``value`` (broadcast to its shape, cast to its dtype).

        In replica context a ``MirroredVariable`` aggregates what every replica passes (one
        merge round) and writes every copy; a ``SyncOnReadVariable`` writes this replica's
        copy. In cross-replica context every copy is written (see the subclasses); across
        workers, outside a ``run()``, every worker makes the write and writes the chief's
        value.

        Args:
            value: an array-like, or in cross-replica context a ``Mirrored`` value.
            use_locking: TF's (a bool, or ``None`` as TF's default), accepted so that TF code
                runs: writes to one variable always take turns, and each is all-or-nothing.
            name: TF's name of the write operation, accepted and unused.
            read_value: ``False``: return ``None`` instead of the variable, as TF does.

        Returns:
            The variable (``None`` with ``read_value=False``).

        Raises:
            ValueError: ``value`` does not broadcast to the variable's shape, or holds an
                integer the variable's integer (or bool) dtype cannot hold (or a Python int
                beyond 64 bits); a
                ``MirroredVariable`` with aggregation ``NONE`` (or an integer one with
                ``MEAN``) given different values by the replicas in replica context; across
                workers, another worker refused its write, or its replicas wrote another
                variable (``WorkersDisagree``).
            TypeError: ``value``'s dtype cannot be cast to the variable's (``same_kind``: an
                int into a float or complex variable is taken, a float into an int one is
                not), is bool and the variable's is not, or is no number; ``value`` makes no
                array (a ragged nested list); a distributed
                value written inside a replica, or a ``PerReplica`` outside one;
                ``use_locking`` is no bool or ``None``, ``read_value`` no bool, or ``name``
                no str or ``None``.
            RuntimeError: written inside a replica of another strategy; across workers,
                written outside a ``run()`` from another task while one is in progress.
            ReplicaSyncError: across workers, outside a ``run()``: a worker failed, or was
                late past ``sync_timeout``.

        Example:
            >>> v = Variable(np.zeros(2))
            >>> anyio.run(v.assign, [1.0, 2.0]).numpy()
            array([1., 2.])
        """
        return await self._written(ASSIGN, "assign()", value, use_locking, name, read_value)

    @overload
    async def assign_add(
        self,
        value: Any,
        use_locking: bool | None = ...,
        name: str | None = ...,
        read_value: Literal[True] = ...,
    ) -> Variable: ...
    @overload
    async def assign_add(
        self,
        value: Any,
        use_locking: bool | None = ...,
        name: str | None = ...,
        read_value: bool = ...,
    ) -> Variable | None: ...
    async def assign_add(
        self,
        value: Any,
        use_locking: bool | None = None,
        name: str | None = None,
        read_value: bool = True,
    ) -> Variable | None:
        """Add ``value`` to the variable (see ``assign`` for the contexts and the other
        arguments).

        Raises:
            ValueError: as ``assign``; on a ``SyncOnReadVariable`` with aggregation ``SUM`` in
                cross-replica context (as in TF).
            TypeError: as ``assign``; on a bool variable (TF has no bool ``AssignAdd``).
            RuntimeError: as ``assign``.

        Example:
            >>> v = Variable(1.0)
            >>> float(anyio.run(v.assign_add, 2.0))
            3.0
        """
        return await self._written(ADD, "assign_add()", value, use_locking, name, read_value)

    @overload
    async def assign_sub(
        self,
        value: Any,
        use_locking: bool | None = ...,
        name: str | None = ...,
        read_value: Literal[True] = ...,
    ) -> Variable: ...
    @overload
    async def assign_sub(
        self,
        value: Any,
        use_locking: bool | None = ...,
        name: str | None = ...,
        read_value: bool = ...,
    ) -> Variable | None: ...
    async def assign_sub(
        self,
        value: Any,
        use_locking: bool | None = None,
        name: str | None = None,
        read_value: bool = True,
    ) -> Variable | None:
        """Subtract ``value`` from the variable (see ``assign`` for the contexts and the other
        arguments).

        Raises:
            ValueError: as ``assign_add``.
            TypeError: as ``assign_add``.
            RuntimeError: as ``assign``.

        Example:
            >>> v = Variable(1.0)
            >>> float(anyio.run(v.assign_sub, 0.25))
            0.75
        """
        return await self._written(SUB, "assign_sub()", value, use_locking, name, read_value)

    async def _written(
        self,
        op: str,
        what: str,
        value: Any,
        use_locking: bool | None,
        name: str | None,
        read_value: bool,
    ) -> Variable | None:
        """``assign``, ``assign_add`` or ``assign_sub`` (``op``; ``what``: its name): across
        workers, one call of every worker's, after the variable's first sync."""
        # Checked on every write of every replica: plain bools pass at the cost of two compares.
        if use_locking.__class__ is not bool or read_value.__class__ is not bool:
            self._check_flags(what, use_locking, read_value)
        if name is not None and not isinstance(name, str):
            raise TypeError(
                f"{what} of variable {self._name!r}: name must be a str or None, got "
                f"{type(name).__name__} {name!r:.60}; nothing was written"
            )
        async with _call(self, what):
            replaced_here = self._unsynced and op == ASSIGN and _broken_before_first_sync(self)
            if self._unsynced and not replaced_here:
                await _sync_first(self)
            await self._write(op, value)
            if replaced_here:
                settle_here(self)
        return self if read_value else None

    def _check_flags(self, what: str, use_locking: Any, read_value: Any) -> None:
        """Refuse a write's (``what``) ``use_locking`` other than a bool or ``None``, or
        ``read_value`` other than a bool.

        Raises:
            TypeError: naming the write, the variable and the argument.
        """
        for argument, given, allowed, said in (
            ("use_locking", use_locking, _LOCKING, "True, False or None"),
            ("read_value", read_value, _BOOLS, "True or False"),
        ):
            if not isinstance(given, allowed):
                raise TypeError(
                    f"{what} of variable {self._name!r}: {argument} must be {said}, got "
                    f"{type(given).__name__} {given!r:.60}; nothing was written"
                )

    async def _write(self, op: str, value: Any) -> Variable:
        """An ordinary variable: one copy, written in any context."""
        device = self._devices[0]
        await self._write_copies(op, [self._checked(op, value, device, None)])
        return self

    async def _write_copies(self, op: str, values: Sequence[Any]) -> None:
        """Write ``values[i]`` into copy ``i`` with ``op``, every copy or (on error) none."""
        async with self._turn:
            commit([(self, await compute_update(self, writer(op), values))])

    def _checked(self, op: str, value: Any, device: Device, replica: int | None) -> Any:
        """``value`` on ``device``, in this variable's dtype, for the write ``op``, or a clear
        error (about the value first, then about ``op``)."""
        where = "" if replica is None else f" from replica {replica}"
        if isinstance(value, DistributedValues):
            value = self._one_value(value, replica)
        if is_array(value):
            array = value
        elif isinstance(value, _SEQUENCES):
            try:
                array = np.asarray(value)
            except (TypeError, ValueError) as exc:  # ragged: NumPy's reason, in our words
                raise TypeError(
                    f"cannot write {type(value).__name__} {value!r:.60} to variable "
                    f"{self._name!r}{where}: it makes no array: {exc}"
                ) from exc
        else:
            # Anything else makes its own array (``__array__``), whose errors stay its own:
            # a variable that cannot be read across replicas raises as its read does.
            array = np.asarray(value)
        if array.dtype == object:
            big = _int_beyond_int64(value)
            if big is not None and self._dtype.kind in "fc":
                array = np.asarray(value, dtype=self._dtype)  # an int into a float: taken
            elif big is not None:  # beyond uint64 too: NumPy keeps it as an object
                raise ValueError(
                    f"cannot write {big} to variable {self._name!r} of dtype "
                    f"{self._dtype}{where}: it fits no NumPy integer dtype, nor this one; "
                    "nothing was written"
                )
            else:
                raise TypeError(
                    f"cannot write {value!r:.60} to variable {self._name!r} of dtype "
                    f"{self._dtype}{where}: it is no array of numbers {_OBJECTS}"
                )
        if isinstance(value, int) and not isinstance(value, bool) and self._dtype.kind in "bu":
            array = self._python_int(value, array, where)
        if array.dtype.kind == "b" and self._dtype.kind != "b":
            # NumPy casts bools to numbers; TF refuses, and a bool here is most likely a
            # mask or a comparison written to the wrong variable.
            raise TypeError(
                f"cannot write a bool value to variable {self._name!r} of dtype "
                f"{self._dtype}{where}: bools are no numbers (as in TF); cast it first "
                f"(e.g. value.astype({self._dtype}))"
            )
        if array.dtype.kind not in "biufc" or not np.can_cast(
            array.dtype, self._dtype, casting="same_kind"
        ):
            raise TypeError(
                f"cannot write a value of dtype {array.dtype} to variable {self._name!r} of "
                f"dtype {self._dtype}{where}; cast it first (e.g. value.astype({self._dtype}))"
            )
        if array.size and array.dtype.kind in "iu" and self._dtype.kind in "iu":
            _check_integer_range(array, self._dtype, f"variable {self._name!r}{where}")
        try:
            shape = np.broadcast_shapes(tuple(array.shape), self._shape)
        except ValueError:
            shape = None
        if shape != self._shape:
            raise ValueError(
                f"cannot write a value of shape {tuple(array.shape)} to variable "
                f"{self._name!r} of shape {self._shape}{where}; it must broadcast to "
                f"{self._shape}"
            )
        if op != ASSIGN and self._dtype.kind == "b":
            adding = op == ADD
            raise TypeError(
                f"{op}() of variable {self._name!r}{where}: a bool variable cannot be "
                f"{'added to' if adding else 'subtracted from'} (TF has no bool "
                f"{'AssignAdd' if adding else 'AssignSub'} either); compute the new value and "
                "assign() it, e.g. `await v.assign("
                f"{'np.logical_or(v, x)' if adding else 'np.logical_and(v, np.logical_not(x))'})`"
            )
        return device.asarray(array)

    def _python_int(self, value: int, array: Any, where: str) -> Any:
        """A Python int (``array``: NumPy's array of it) written to an unsigned or bool
        variable, in the variable's dtype: it has no dtype of its own, so it takes the
        variable's where it fits, as it does into a signed one (and as TF converts it).

        Raises:
            ValueError: the variable's dtype cannot hold ``value``.
        """
        if self._dtype.kind == "u":
            _check_integer_range(array, self._dtype, f"variable {self._name!r}{where}")
            return array.astype(self._dtype)
        if value not in (0, 1):
            raise ValueError(
                f"cannot write {value} to variable {self._name!r}{where} of dtype bool, which "
                "holds 0 (False) and 1 (True); write a bool, or compare first (value != 0)"
            )
        return np.asarray(bool(value))

    def _one_value(self, value: DistributedValues[Any], replica: int | None) -> Any:
        """What a write outside a replica takes of a ``Mirrored`` ``value`` (one value on
        every replica: replica 0's copy), or a clear error for any other distributed value,
        and for any written inside a replica.

        Raises:
            TypeError: ``value`` is written inside a replica, or is a ``PerReplica``.
        """
        kind = type(value).__name__
        in_replica = context_state.get().replica
        if replica is None and in_replica is not None:
            replica = in_replica.replica_id_in_sync_group
        if replica is not None:
            raise TypeError(
                f"cannot write a {kind} value to variable {self._name!r} from replica "
                f"{replica}: a distributed value holds one value per replica and cannot be "
                "written from a replica; pass this replica's own value (run() hands each "
                "replica its own part of a PerReplica or Mirrored argument)"
            )
        if isinstance(value, Mirrored):
            return value.values[0]
        raise TypeError(
            f"variable {self._name!r} was written outside a replica with a {kind} value, "
            "which holds a different value per replica; reduce it first (strategy.reduce), "
            "or pass it to strategy.run() and write each replica's own part there"
        )

    async def _written_values(self, op: str, value: Any) -> list[Any]:
        """One checked value per copy for a write in cross-replica context (``op``: assign,
        assign_add or assign_sub).

        Across workers, outside a ``run()``, it is the chief's value, as a new variable's
        initial value is: every worker makes the write, and the chief's value (after its own
        checks) is broadcast to the others first, so the copies stay identical whatever each
        worker passed. A write in a ``merge_fn`` takes its value as it is, as in TF, without
        a collective: the value every worker passes there is the same (a reduced one).

        Raises:
            TypeError, ValueError: as ``_cross_replica_values`` (across workers, refused on
                every worker in step: the others raise ``WorkersDisagree`` naming this one).
            RuntimeError: called in another strategy's scope (``_check_own_strategy``;
                across workers refused on every worker in step, as bad values are); across
                workers, called from another task while a ``run()`` is in progress on this
                worker.
        """
        engine = _writing_as_the_chief(self)
        if engine is None:
            self._check_own_strategy(op)
            return self._cross_replica_values(op, value)
        what = f"{op}() of variable {self._name!r}"
        try:
            self._check_own_strategy(op)
            values = self._cross_replica_values(op, value)
        except (TypeError, ValueError, RuntimeError) as exc:
            await engine.refuse(what, exc)
            raise
        # In the variable's dtype and shape, which every worker's broadcast agrees on.
        mine = [
            device.xp.broadcast_to(copy.astype(self._dtype, copy=False), self._shape)
            for copy, device in zip(values, self._devices, strict=True)
        ]
        # The workers compare which variable it is, too (by number: names may repeat).
        return await engine.broadcast(PerReplica(mine), 0, f"{op}() of {variable_label(self)}")

    def _check_own_strategy(self, op: str) -> None:
        """Refuse a cross-replica write (``op``) of this distributed variable in the scope, or
        a ``merge_fn``, of another strategy, as TF refuses to mix strategies and as that
        strategy's replicas and ``extended.update`` refuse it; nothing is written.

        Raises:
            RuntimeError: naming the variable and both strategies.
        """
        current = context_state.get().strategy
        if current is not None and current is not self._strategy:
            shown = repr(self._strategy)
            raise RuntimeError(
                f"{op}() of variable {self._name!r}, created in the scope of {shown}, was "
                f"called in the scope of {other_strategy(shown, current, repr(current))}; "
                'strategies cannot be mixed (TF: "Mixing different tf.distribute.Strategy '
                'objects"): '
                "write it outside that scope, or in its own strategy's"
            )

    def _cross_replica_values(self, op: str, value: Any) -> list[Any]:
        """One checked value per copy from the argument of a write (``op``) in cross-replica
        context."""
        if isinstance(value, PerReplica):
            raise TypeError(
                f"variable {self._name!r} was written in cross-replica context with a "
                "PerReplica value, which holds a different value per replica; reduce it "
                "first (strategy.reduce) or write it from replica context, inside run()"
            )
        if isinstance(value, DistributedValues):
            if len(value.values) != len(self._devices):
                raise ValueError(
                    f"variable {self._name!r} has {len(self._devices)} copies but the "
                    f"Mirrored value written to it has {len(value.values)}"
                )
            components = list(value.values)
        else:
            components = [value] * len(self._devices)
        return [
            self._checked(op, component, device, None)
            for component, device in zip(components, self._devices, strict=True)
        ]


@final
class VariableRef:
    """A hashable reference to a variable (``v.ref()``), equal to every other reference to
    the same variable, as TF's.

    Example:
        >>> v = Variable(1.0)
        >>> v.ref() == v.ref(), v.ref() == Variable(1.0).ref()
        (True, False)
    """

    __slots__ = ("_variable",)

    def __init__(self, variable: Variable) -> None:
        self._variable = variable

    def deref(self) -> Variable:
        """The variable referred to."""
        return self._variable

    def __hash__(self) -> int:
        return id(self._variable)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VariableRef) and other._variable is self._variable

    def __repr__(self) -> str:
        return f"<Reference to {self._variable!r}>"


@final
class MirroredVariable(Variable):
    """A variable whose copies, one per replica, are always equal.

    Made by ``Variable(...)`` in a strategy's scope with ``synchronization`` ``AUTO`` or
    ``ON_WRITE``. Reads in cross-replica context return the primary copy (replica 0's).

    Writes in replica context (every replica must make the same write) take one merge round:
    the values of all replicas are combined with the variable's aggregation (``SUM``,
    ``MEAN``, or ``ONLY_FIRST_REPLICA``: replica 0's) and written to every copy. With
    aggregation ``NONE`` (or ``MEAN`` of an integer dtype) every replica must write the same
    value, which every copy takes; different values raise ``ValueError``, since the copies
    would otherwise drift apart. Writes in cross-replica context write every copy. Every write is
    all-or-nothing: if it fails or is cancelled, every copy keeps its old value.

    Raises:
        ValueError: made outside a strategy scope, or with ``synchronization`` ``ON_READ``
            or ``NONE`` (and as ``Variable``).

    Example:
        >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> with strategy.scope():
        ...     total = Variable(0.0, aggregation="sum")
        >>> async def step():
        ...     ctx = aioreplica.get_replica_context()
        ...     await total.assign_add(ctx.replica_id_in_sync_group + 1.0)
        >>> anyio.run(strategy.run, step)
        >>> float(total)
        3.0
    """

    __slots__ = ()

    async def _write(self, op: str, value: Any) -> Variable:
        replica = context_state.get().replica
        if replica is None:
            await self._write_copies(op, await self._written_values(op, value))
            return self
        self._replica_id(replica, op)
        try:
            local = self._checked(op, value, replica.device, replica.replica_id_in_sync_group)
        except (TypeError, ValueError) as exc:
            replica._engine.refusing(f"{op}() of variable {self._name!r}", exc)
            raise
        local = replica.device.xp.broadcast_to(local.astype(self._dtype, copy=False), self._shape)
        # A collective: the strategy's CommunicationOptions.timeout_seconds bounds its wait.
        timeout = replica._engine.options._timeout
        await replica._collective(_merge_write, (self, op, local, value), timeout)
        return self


@final
class SyncOnReadVariable(Variable):
    """A variable each replica writes on its own; read across replicas, its copies combine.

    Made by ``Variable(..., synchronization="on_read", aggregation=...)`` in a strategy's
    scope, typically for metrics: each replica accumulates into its own copy with no
    communication, and a read in cross-replica context returns the aggregate (``SUM``,
    ``MEAN``, or ``ONLY_FIRST_REPLICA``: replica 0's copy). With aggregation ``NONE`` (the
    default, as in TF) the copies have no aggregate: replicas read and write their own, and a
    cross-replica read (a checkpoint's too) raises ``ValueError``; ``strategy.reduce(op, v)``
    combines the copies with an op of the caller's choosing.

    Writes in replica context change this replica's copy only. In cross-replica context
    ``assign`` writes every copy so that the aggregate equals the value (with ``SUM`` each
    copy gets ``value / num_replicas``; integers: the quotient, with the remainder on replica
    0's copy); ``assign_add``/``assign_sub`` apply to every copy, and raise with ``SUM``, as
    in TF.

    Raises:
        ValueError: made outside a strategy scope, or with a ``synchronization`` other than
            ``ON_READ`` (and as ``Variable``); read in cross-replica context with aggregation
            ``NONE``.

    Example:
        >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> with strategy.scope():
        ...     seen = Variable(0, synchronization="on_read", aggregation="sum")
        >>> async def step(rows):
        ...     await seen.assign_add(rows)
        >>> anyio.run(strategy.run, step, (aioreplica.PerReplica([3, 4]),))
        >>> int(seen)
        7
    """

    __slots__ = ()

    def _read_cross_replica(self) -> Any:
        if self._aggregation is _Agg.NONE:
            raise ValueError(
                f"sync-on-read variable {self._name!r} has aggregation NONE, so its copies "
                "cannot be combined in cross-replica context (as in TF): read it inside a "
                "replica, where each reads its own copy, reduce its copies with "
                "strategy.reduce(op, variable), or give it aggregation 'sum', 'mean' or "
                "'only_first_replica'"
            )
        copies = self._copies
        engine = self._engine
        if engine is not None and engine.cluster is not None:
            return self._read_all_workers(engine.cluster)
        if self._aggregation is _Agg.ONLY_FIRST_REPLICA or len(copies) == 1:
            return copies[0]
        op = "mean" if self._aggregation is _Agg.MEAN else "sum"
        devices = self._devices
        return frozen(devices[0].backend.reduce_to_first(op, copies, devices))

    def _shown(self) -> str:
        """Across workers, this worker's copies: its cross-replica read is a collective, which
        a repr (a log line on the chief alone, say) must not make."""
        engine = self._engine
        if engine is None or engine.cluster is None:
            return super()._shown()
        copies = ", ".join(
            repr(host_array(c, d)) for c, d in zip(self._copies, self._devices, strict=True)
        )
        return f"<aggregated over every worker when read; this worker's copies: {copies}>"

    def _read_all_workers(self, workers: Workers) -> Any:
        """The aggregate over every worker's copies (a collective every worker makes):
        ``ONLY_FIRST_REPLICA`` is the chief's first copy."""
        return frozen(self._devices[0].asarray(self._host_over_workers(workers)))

    def _host_over_workers(self, workers: Workers, caller: str = "") -> np.ndarray[Any, Any]:
        """``_read_all_workers`` on the host, with blocking MPI calls (a synchronous read;
        ``caller``: what reads it, which the read's name says)."""
        if self._unsynced:
            sync_variables_now(self._engine)
        copies, devices = self._copies, self._devices
        if self._aggregation is _Agg.ONLY_FIRST_REPLICA:
            value = np.array(host_array(copies[0], devices[0]), order="C", copy=True)
        else:
            local = devices[0].backend.reduce_to_first("sum", copies, devices)
            # MPI sums numbers in this machine's byte order only: the sum is made in it, and
            # given back in the variable's dtype by ``_aggregated``.
            value = in_native_order(np.array(host_array(local, devices[0]), copy=True))
        what, post = self._over_workers(value, workers, caller)
        workers.blocking(what, lambda comm, wait: wait(post(comm), post))
        return self._aggregated(value)

    async def _read_over_workers(
        self, copies: tuple[Any, ...], workers: Workers, caller: str = ""
    ) -> np.ndarray[Any, Any]:
        """``_host_over_workers`` of ``copies`` (this worker's, as a snapshot took them),
        without blocking the event loop: the copies combine where their device computes, come
        to the host through ``to_host``, and the workers' read is awaited."""
        device = self._devices[0]
        if self._aggregation is _Agg.ONLY_FIRST_REPLICA:
            value = await device.backend.to_host(copies[0], device)
        else:
            nbytes = sum([getattr(copy, "nbytes", 0) for copy in copies])
            reduce = device.backend.reduce_to_first
            local = await device.compute(nbytes, reduce, "sum", copies, self._devices)
            value = in_native_order(await device.backend.to_host(local, device))
        what, post = self._over_workers(value, workers, caller)
        await workers.read(what, post, value.nbytes)
        return self._aggregated(value)

    def _over_workers(
        self, value: np.ndarray[Any, Any], workers: Workers, caller: str
    ) -> tuple[str, Callable[[Any], Any]]:
        """What every worker's read of this variable names (the workers compare it; with what
        reads it, ``caller``, if given), and its MPI call on ``value``, this worker's part on
        the host, where the result lands: the chief's first copy for ``ONLY_FIRST_REPLICA``,
        else the sum over the workers."""
        mpi = workers.mpi
        # By its number too: two variables of one name and shape read in another order on
        # each worker must not pair.
        shown = f"{_identity(self)} ({value.dtype.name} {value.shape})"
        what = f"reading sync-on-read variable {shown}"
        if caller:
            what = f"{what} for {caller}"
        if self._aggregation is _Agg.ONLY_FIRST_REPLICA:
            return what, lambda comm: comm.Ibcast([raw_bytes(value), mpi.BYTE], 0)
        return what, lambda comm: comm.Iallreduce(mpi.IN_PLACE, value, mpi.SUM)

    def _aggregated(self, value: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The read over the workers (``value``, as ``_over_workers``'s call left it) in the
        variable's dtype: the mean divides the sum by every worker's replicas."""
        if self._aggregation is _Agg.MEAN:
            np.divide(value, self._engine.num_replicas, out=value)  # type: ignore[union-attr]
        return value.astype(self._dtype, copy=False)

    async def _write(self, op: str, value: Any) -> Variable:
        replica = context_state.get().replica
        if replica is not None:
            replica_id = self._replica_id(replica, op)
            local = self._checked(op, value, replica.device, replica.replica_id_in_sync_group)
            async with self._turn:
                copy = self._copies[replica_id]
                new = (await compute_copies((replica.device,), writer(op), [[copy], [local]]))[0]
                copies = list(self._copies)
                copies[replica_id] = new
                commit([(self, copies)])
            return self
        values = await self._written_values(op, value)
        if op != ASSIGN or self._aggregation is not _Agg.SUM:
            await self._write_copies(op, values)
            return self
        async with self._turn:
            commit([(self, await _shares_of_sum(self, values))])
        return self

    def _cross_replica_values(self, op: str, value: Any) -> list[Any]:
        if op != ASSIGN and self._aggregation is _Agg.SUM:
            raise ValueError(
                f"{op}() on SyncOnReadVariable {self._name!r} in cross-replica context is not "
                "supported with aggregation SUM (it would change the sum by num_replicas "
                "times the value); call it in replica context, or assign() the new total"
            )
        return super()._cross_replica_values(op, value)


register_copied_type(Variable)


# -- several workers: every variable starts from the chief's value -----------------------


async def sync_variables(workers: Workers) -> None:
    """Give the variables made since the last call the chief's values (collective).

    Every worker makes its variables in the same order, so the ``k``-th pending variable is
    the same on each: broadcast from worker 0 one by one, in creation order. The workers
    compare each one's number, name, kind (mirrored or sync-on-read), aggregation, dtype and
    shape first, so variables made in another order or of another kind (or one made on some
    workers only) raise ``WorkersDisagree`` instead of taking the chief's value of another
    variable.
    """
    pending = workers.pending
    while pending:
        variable = pending[0]  # pending until synced: a refused broadcast leaves it to retry
        copy, device = variable._copies[0], variable._devices[0]
        # (a host copy goes as it is: the broadcast copies it)
        host = await device.backend.to_host(copy, device) if is_cupy_array(copy) else copy
        made = f"{variable_label(variable)} {_kind(variable)}"
        try:
            value = await workers.broadcast(host, 0, made)
        except WorkersDisagree as exc:
            _note_unsynced(exc, pending)
            raise
        _start_from(variable, value)
        del pending[0]


def _note_unsynced(error: WorkersDisagree, pending: list[Any]) -> None:
    """Say what a disagreement in a first sync means for the calls after it."""
    add_note(
        error,
        f"new variables are not synced here ({', '.join(map(_identity, pending))}): every "
        "worker must make the same variables in the same order (a variable whose making "
        "failed on one worker must not be made on the others). Every cross-worker call "
        "syncs new variables first, so each raises this again: make a new strategy, and the "
        "variables again, on every worker",
    )


def variable_label(variable: Variable) -> str:
    """``variable`` as the workers compare it in what a collective is for: ``"variable "``
    and its ``_identity``."""
    return f"variable {_identity(variable)}"


def _identity(variable: Variable) -> str:
    """``variable``'s number among the variables made on the communicator (two variables may
    share a name), then its name; in one process (and for slots, which follow their
    variables), its name."""
    if variable._number is None:
        return repr(variable._name)
    return f"#{variable._number} {variable._name!r}"


def _kind(variable: Variable) -> str:
    """What every worker's ``k``-th variable must be alike besides its name, dtype and shape,
    which its first sync compares: mirrored or sync-on-read, and its aggregation."""
    kind = "sync-on-read" if isinstance(variable, SyncOnReadVariable) else "mirrored"
    return f"({kind}, {variable._aggregation.value})"


async def _sync_first(variable: Variable) -> None:
    """Before ``variable``'s first write: every pending variable takes the chief's values."""
    engine = variable._engine
    if engine is not None and engine.cluster is not None:
        await sync_variables(engine.cluster)


def sync_variables_now(engine: ReductionEngine | None) -> None:
    """``sync_variables`` for a synchronous read, with blocking MPI calls (every worker reads).

    Raises:
        RuntimeError: another cross-worker call or collective is in progress on this worker.
    """
    workers = engine.cluster if engine is not None else None
    if workers is None or not workers.pending:
        return
    pending = workers.pending
    comm_byte = workers.mpi.BYTE

    def broadcast(comm: Any, wait: Callable[[Any, object], None]) -> None:
        for variable in pending:
            copy = host_array(variable._copies[0], variable._devices[0])
            value = np.array(copy, order="C", copy=True)
            # As bytes: MPI refuses typed data in another byte order than this machine's.
            wait(comm.Ibcast([raw_bytes(value), comm_byte], 0), value)
            _start_from(variable, value)

    # What every worker's variables are, so that workers disagreeing refuse before any data.
    made = ", ".join(f"{_identity(v)} {v._dtype.name} {v.shape} {_kind(v)}" for v in pending)
    try:
        workers.blocking(f"the first read of variables {made}", broadcast)
    except WorkersDisagree as exc:
        _note_unsynced(exc, pending)
        raise
    workers.pending = []


def _broken_before_first_sync(variable: Variable) -> bool:
    """Whether ``variable`` still waits for the chief's first value on a cluster that broke
    before it came: that sync can never be made now, and only a write that replaces every
    copy (an ``assign``, a restore) gives the variable a value of its own here."""
    engine = variable._engine
    workers = engine.cluster if engine is not None else None
    return variable._unsynced and workers is not None and workers.broken


def settle_here(variable: Variable) -> None:
    """After a write that replaced every copy of ``variable`` committed, on a cluster that
    broke before its first sync: the variable holds this worker's own value from now on, as
    every other variable does after the failure (docs/multi-worker.md), so reads no longer
    ask the chief for a first value that can never come. Nothing to do otherwise."""
    if _broken_before_first_sync(variable):
        variable._unsynced = False
        pending = variable._engine.cluster.pending  # type: ignore[union-attr]
        # By identity: a variable's == compares values, which would read the others.
        pending[:] = [other for other in pending if other is not variable]


async def _sync_before_replacing(variable: Variable) -> None:
    """Before every worker computes new copies of ``variable`` alike (a restore, an update
    outside a ``run()``): a variable not used yet takes the chief's value first, with the
    other new variables, as before its first write. Its first sync copies the chief's first
    copy into every copy, which would replace the new copies where they differ (a ``SUM``
    sync-on-read variable's split total, an update's per-replica arguments). Nothing to do
    where the workers make no collectives together (``_agreeing``)."""
    engine = _agreeing(variable._engine) if variable._unsynced else None
    if engine is not None and engine.cluster is not None:
        await sync_variables(engine.cluster)


def _global_copies(variable: Variable) -> tuple[int | None, int]:
    """How many copies of ``variable`` every worker holds, and this worker's first one's
    global index (``(None, 0)``: one process)."""
    engine = variable._engine
    if engine is None or engine.cluster is None:
        return None, 0
    return engine.num_replicas, engine.first_replica


def _start_from(variable: Variable, value: np.ndarray[Any, Any]) -> None:
    variable._copies = tuple(frozen(device.asarray(value)) for device in variable._devices)
    variable._unsynced = False


# -- writing ------------------------------------------------------------------------------


async def new_copies(variable: Variable, host_value: np.ndarray[Any, Any]) -> tuple[Any, ...]:
    """Copies of ``variable`` holding ``host_value`` (a checkpoint's saved value), uncommitted.

    A sync-on-read variable with ``SUM`` aggregation gets ``value / num_copies`` in each copy
    (integers: exactly, the remainder on copy 0), so its aggregate is the saved value.

    Across workers (every worker restores the same file) a variable not used yet takes the
    chief's value first (``_sync_before_replacing``); a restore that fails after that leaves
    it holding the value it had, the chief's.
    """
    await _sync_before_replacing(variable)
    value = host_value.astype(variable._dtype, copy=False)
    placed = [device.asarray(value) for device in variable._devices]
    if isinstance(variable, SyncOnReadVariable) and variable._aggregation is _Agg.SUM:
        return await _shares_of_sum(variable, placed)
    return await compute_update(variable, writer(ASSIGN), placed)


async def _shares_of_sum(variable: Variable, values: Sequence[Any]) -> tuple[Any, ...]:
    """New copies of a ``SUM`` sync-on-read ``variable``, uncommitted, whose sum over every
    copy (every worker's) is ``values[i]`` (one per copy): ``value / num_copies`` each,
    integers exactly, the remainder on global copy 0. Split where the write runs
    (``compute_copies``: a large one off the event loop's thread), not here."""
    devices = variable._devices
    total, first = _global_copies(variable)
    firsts = [first + i == 0 for i in range(len(devices))]
    split = share_writer(variable._dtype, total if total is not None else len(devices))
    return await compute_update(variable, split, values, firsts)


def snapshot(variable: Variable) -> tuple[Any, Device]:
    """What a checkpoint saves of ``variable`` (its cross-replica read), and on which device.

    A reference, taken synchronously: copies are never written in place, so snapshots of many
    variables taken in one go are consistent with each other, whatever runs afterwards. A
    ``SUM`` or ``MEAN`` sync-on-read variable's copies in one process are kept as they are, an
    ``Aggregate`` that the caller combines later (``Aggregate.value``): combining large copies
    here would hold the event loop. Across workers, a sync-on-read variable's copies are kept
    as ``AcrossWorkers``, which the caller reads over the workers later
    (``AcrossWorkers.read``, a collective): that read, now, would hold the event loop until
    every worker's part had come.

    Raises:
        ValueError: a sync-on-read variable with aggregation ``NONE``.
    """
    engine = variable._engine
    if isinstance(variable, SyncOnReadVariable) and variable._aggregation is not _Agg.NONE:
        if engine is not None and engine.cluster is not None:
            return AcrossWorkers(variable, engine.cluster), variable._devices[0]
        if variable._aggregation is not _Agg.ONLY_FIRST_REPLICA and len(variable._copies) > 1:
            op = "mean" if variable._aggregation is _Agg.MEAN else "sum"
            return Aggregate(op, variable._copies, variable._devices), variable._devices[0]
    return variable._read_cross_replica(), variable._devices[0]


@final
class Aggregate:
    """A sync-on-read variable's copies as ``snapshot`` took them, and how they combine
    (``op``: ``"sum"`` or ``"mean"``), computed by ``value``."""

    __slots__ = ("copies", "devices", "op")

    def __init__(self, op: str, copies: Sequence[Any], devices: Sequence[Device]) -> None:
        self.op = op
        self.copies = tuple(copies)
        self.devices = tuple(devices)

    async def value(self) -> Any:
        """The combined copies, on the first device, computed where that device runs work
        that reads that many bytes (``device.compute``): large work off the event loop's
        thread (invariant 4)."""
        device = self.devices[0]
        nbytes = sum([getattr(copy, "nbytes", 0) for copy in self.copies])
        return await device.compute(
            nbytes, device.backend.reduce_to_first, self.op, self.copies, self.devices
        )


@final
class AcrossWorkers:
    """A sync-on-read variable of several workers as ``snapshot`` took it: this worker's
    copies then, which ``read`` aggregates over every worker."""

    __slots__ = ("copies", "variable", "workers")

    def __init__(self, variable: SyncOnReadVariable, workers: Workers) -> None:
        self.variable = variable
        self.copies = variable._copies
        self.workers = workers

    async def read(self, caller: str = "") -> np.ndarray[Any, Any]:
        """The aggregate over every worker, on the host: a collective, which every worker
        makes in the same order, awaited without holding the event loop (``caller``: what
        reads it, which the read's name says). The variable has taken the chief's values."""
        assert not self.variable._unsynced, "sync_variables() first"
        return await self.variable._read_over_workers(self.copies, self.workers, caller)

    def read_now(self, caller: str) -> np.ndarray[Any, Any]:
        """``read`` with blocking MPI calls, now, of the copies the variable holds now (a new
        variable first takes the chief's values): for a variable of another strategy than
        the one whose call the caller holds, whose turn it cannot await."""
        return self.variable._host_over_workers(self.workers, caller)


async def host_value(variable: Variable) -> np.ndarray[Any, Any]:
    """``variable``'s value as a cross-replica read gives it, on the host, read without a
    host sync on the event loop's thread: a GPU's copy comes in a worker thread, a read over
    the workers is awaited."""
    value, device = snapshot(variable)
    if isinstance(value, AcrossWorkers):
        return await value.read()
    if isinstance(value, Aggregate):
        value = await value.value()
    return await to_host(value, device)


def slot_variable(variable: Variable, name: str, *, initial_value: float = 0.0) -> Variable:
    """A new variable beside ``variable``: same devices and strategy, mirrored, every element
    ``initial_value`` (zero unless given).

    Optimizers keep their per-variable state (momentum, moments, accumulators) in these. Its
    copies are made here, on the calling thread: ``filled_slot_variable`` makes them on the
    devices.
    """
    slot = _slot_beside(variable, name)
    array = np.full(variable._shape, initial_value, variable._dtype)
    slot._copies = tuple(frozen(device.asarray(array)) for device in slot._devices)
    return slot


async def filled_slot_variable(
    variable: Variable, name: str, *, initial_value: float = 0.0
) -> Variable:
    """``slot_variable``, its copies filled where each device's rule puts work of their size
    (``device.compute``: a big host array on the device's worker thread, a GPU's on its
    stream), so that a step's first use of a big variable does not block the event loop."""
    slot = _slot_beside(variable, name)
    slot._copies = await compute_update(variable, functools.partial(_full_like, initial_value))
    return slot


def _slot_beside(variable: Variable, name: str) -> Variable:
    """A slot of ``variable`` (see ``slot_variable``) without its copies yet."""
    mirrored = variable._strategy is not None
    slot = object.__new__(MirroredVariable if mirrored else Variable)
    slot._describe(
        variable._strategy,
        variable._engine,
        name,
        variable._dtype,
        variable._shape,
        False,
        _Sync.ON_WRITE if mirrored else _Sync.AUTO,
        _Agg.NONE,
    )
    return slot


def _full_like(value: float, copy: Any) -> Any:
    """A new array of ``copy``'s shape and dtype, on its device, every element ``value``."""
    return array_module(copy).full(copy.shape, value, copy.dtype)


async def _merge_write(strategy: Any, variable: Any, op: Any, value: Any, given: Any) -> None:
    """A ``MirroredVariable`` write from replica context: aggregate, then write every copy.

    ``given`` is what each replica passed, before conversion: the very same object from every
    replica is one value, not one per replica, and cannot be summed (as in TF), unless it
    stands for one value per replica (``_one_per_replica``).
    """
    engine: ReductionEngine = strategy._engine
    try:
        variable = agreed(variable, "the variable the replicas write")
        op = agreed(op, "the kind of write (assign, assign_add, assign_sub)")
        assert isinstance(variable, MirroredVariable)
        if (
            variable._aggregation is _Agg.SUM
            and len(variable._devices) > 1
            and not isinstance(given, DistributedValues)
            and not _one_per_replica(given)
        ):
            raise ValueError(
                f"{op}() of MirroredVariable {variable._name!r} (aggregation SUM): every "
                f"replica passed the same object ({short_repr(given)}), which is one value, not "
                "one per replica, so it cannot be reduced with SUM (it would count it once per "
                'replica; TF refuses it too: "A non-DistributedValues value cannot be reduced '
                'with the given reduce op"). A literal, a name the replicas share, and an int '
                "from -5 to 256 (CPython keeps one object for each, so equal counts such as "
                "len(batch) are one object) are the same object everywhere; pass a value made "
                "in each replica (for a count, np.int64(n) or np.float64(n) as the variable's "
                "dtype takes it), use aggregation 'mean' or 'only_first_replica', or write it "
                "in cross-replica context"
            )
    except (ValueError, ReplicaSyncError) as exc:
        await engine.refuse("a write of a variable", exc)  # on every worker alike
        raise
    if engine.cluster is None:
        reduced = await _aggregate(variable, value)
    else:  # every worker's replicas write the same variable: the workers compare which
        with reductions_for(f"{op}() of {variable_label(variable)}"):
            reduced = await _aggregate(variable, value)
    await variable._write_copies(op, reduced)


def _one_per_replica(given: Any) -> bool:
    """Whether ``given``, the very object that every replica passed to a write of a ``SUM``
    mirrored variable, still stands for one value per replica, which the sum counts once per
    replica (as TF sums them):

    - a distributed variable: each replica wrote its own copy, read in the replica (TF's
      regroup keeps the variable, and its reduction sums the copies);
    - a read-only NumPy array: what the library hands every host replica as one shared array
      (a host collective's output, a mirrored variable's host copy), where GPU replicas get
      an array each, which TF sums too (a read-only array read outside the step cannot be
      told apart: it is summed as well, where TF would refuse it);
    - a Python or NumPy scalar equal to 0, which TF's ``reduce_non_distributed_value`` reduces
      to 0 (so ``assign(0.0)`` resets the variable in replica context).

    A writeable array or any other number shared by every replica is one value: refused.
    """
    if isinstance(given, MirroredVariable | SyncOnReadVariable):
        return True
    if isinstance(given, np.ndarray):
        return not given.flags.writeable
    return isinstance(given, int | float | complex | np.generic) and bool(given == 0)


async def _aggregate(variable: Variable, value: Any) -> list[Any]:
    """The replicas' values combined with the variable's aggregation, one per copy."""
    engine = variable._engine
    assert engine is not None  # a mirrored variable always has its strategy's engine
    devices = variable._devices
    if variable._aggregation is _Agg.ONLY_FIRST_REPLICA:
        if engine.cluster is not None:  # replica 0 of every worker's: the chief's first
            return await engine.broadcast(value, 0, f"a write of {variable_label(variable)}")
        first = value.values[0] if isinstance(value, DistributedValues) else value
        return await engine.broadcast_to(first, devices)
    agg = variable._aggregation
    if agg is _Agg.NONE or (agg is _Agg.MEAN and variable._dtype.kind not in "fc"):
        return await _the_one_value(variable, value)
    op = ReduceOp.SUM if variable._aggregation is _Agg.SUM else ReduceOp.MEAN
    return (await engine.batch_reduce_to(op, [(value, devices)]))[0]


async def _the_one_value(variable: Variable, value: Any) -> list[Any]:
    """What a variable without an aggregation (or an integer or bool one with ``MEAN``,
    whose mean its dtype cannot hold) takes in replica context: the value, when every replica
    (of every worker) passed the same one, bit for bit (so NaNs and complex numbers compare
    too, and the copies stay bitwise identical), as TF writes each replica's own.

    Raises:
        ValueError: the replicas passed different values.
    """
    engine = variable._engine
    assert engine is not None
    devices = variable._devices
    parts = value.values if isinstance(value, DistributedValues) else (value,) * len(devices)
    if (await bits_differ(engine, [parts]))[0]:
        why = (
            "which it has no aggregation to combine; pass the same value from every replica, "
            "give it aggregation 'sum', 'mean' or 'only_first_replica'"
            if variable._aggregation is _Agg.NONE
            else "whose mean the dtype cannot hold (as in TF); pass the same value from every "
            "replica, use a floating dtype"
        )
        error = ValueError(
            f"cannot write MirroredVariable {variable._name!r} of dtype {variable._dtype} with "
            f"aggregation {variable._aggregation.name} in replica context: the replicas "
            f"passed different values{await which_differ(parts, engine)}, "
            f"{why}, or write it in cross-replica context"
        )
        await engine.refuse("a write of a variable", error)  # every worker raises alike
        raise error
    return await engine.broadcast_to(parts[0], devices)  # replica 0's: every one's, bitwise


async def bits_differ(engine: ReductionEngine, values: Sequence[Sequence[Any]]) -> list[bool]:
    """For each of ``values`` (one array per local replica, on its device), whether the
    replicas (of every worker) hold different bits: two packed reductions, ``MAX`` and
    ``MIN`` of the bytes, which agree only where every replica's bytes are equal."""
    devices = engine.devices
    bits = [
        PerReplica(
            [await d.compute(p.nbytes, _bytes_of, p) for d, p in zip(devices, parts, strict=True)]
        )
        for parts in values
    ]
    pairs = [(b, devices) for b in bits]
    high = await engine.batch_reduce_to(ReduceOp.MAX, pairs)
    low = await engine.batch_reduce_to(ReduceOp.MIN, pairs)
    return [
        not await _holds(devices[0], h[0].nbytes + lo[0].nbytes, _equal, h[0], lo[0])
        for h, lo in zip(high, low, strict=True)
    ]


async def _holds(device: Device, nbytes: int, test: Callable[..., Any], *arrays: Any) -> bool:
    """``bool(test(*arrays))`` for arrays on ``device``, tested where the device's rule puts
    work that reads ``nbytes`` (``device.compute``: small host work inline, the rest on the
    device's worker thread, a GPU's on its stream) and read without a host sync on the event
    loop's thread (invariant 4): a GPU's answer is copied to the host in a worker thread."""
    return bool(await to_host(await device.compute(nbytes, test, *arrays), device))


def _equal(first: Any, other: Any) -> Any:
    """Whether two arrays of one device are equal, NaN equal to NaN where the dtype has NaNs
    (a 0-d array of that device, or a bool)."""
    xp = array_module(first)
    if first.dtype.kind in "fc" and other.dtype.kind in "fc":
        return xp.array_equal(first, other, equal_nan=True)
    return xp.array_equal(first, other)


def _bytes_of(array: Any) -> Any:
    """``array``'s bytes, flat (MAX and MIN of them over the replicas tell equal bits); a
    floating zero's sign does not count (``-0.0 + 0.0`` is ``0.0``)."""
    if array.dtype.kind in "fc":
        array = array + 0
    return array_module(array).ascontiguousarray(array).reshape(-1).view("u1")


async def which_differ(parts: Sequence[Any], engine: ReductionEngine) -> str:
    """Which of this process's replicas passed another value than its first, for a message
    (``""`` when they agree here: the difference is another worker's).

    Each replica's value is compared with the first's bytes on its own device, where the
    device's rule puts work of that size, and the first one's text lists no more than a few
    of its elements: a refused write of a big array does not block the event loop.
    """
    first_replica = engine.first_replica
    devices = engine.devices
    odd = []
    for i, (part, device) in enumerate(zip(parts, devices, strict=True)):
        if part is parts[0]:
            continue
        first = device.asarray(parts[0])  # on this replica's device, in order
        if not await _holds(device, part.nbytes + first.nbytes, _same_bits, first, part):
            odd.append(first_replica + i)
    if not odd:
        return ""
    first = await _array_text(parts[0], devices[0])
    return f" ({replica_list(odd)} passed another than replica {first_replica}'s {first})"


def _same_bits(first: Any, other: Any) -> Any:
    """Whether two arrays of one device hold the same bytes (see ``_bytes_of``)."""
    return array_module(first).array_equal(_bytes_of(first), _bytes_of(other))


#: Elements beyond which an array's values, as a list, cannot fit ``_array_text``'s 40
#: characters (``[0, 0, ...]`` takes 3 per element).
_LISTED: Final = 13


async def _array_text(array: Any, device: Device) -> str:
    """``array``'s values as a list, or elided in the middle when that is long:
    ``[0., 0., ..., 0., 0.]``. NumPy formats the elided text from the corners alone; a GPU
    array is copied to the host in a worker thread first."""
    array = await to_host(array, device)
    if array.size <= _LISTED:
        shown = repr(array.tolist())
        if len(shown) <= 40:
            return shown
    text = np.array2string(array, threshold=6, edgeitems=2, max_line_width=1 << 20, separator=", ")
    return " ".join(text.split())


# -- updates (strategy.extended.update) -----------------------------------------------------


async def update(
    strategy: Any,
    variable: Variable,
    fn: Callable[..., Any],
    args: Any,
    kwargs: Any,
) -> tuple[Any, ...]:
    """``strategy.extended.update``: the new value of every copy is ``fn(copy, *args)``.

    Returns the new copies, one per replica (in replica context every replica gets them all,
    after one merge round); the facade groups them as its caller asked. Across workers,
    outside a ``run()``, a variable not used yet takes the chief's value first, and arguments
    refused on one worker are refused on every worker.
    """
    replica = context_state.get().replica
    if replica is not None:
        try:
            args, kwargs = _update_call(variable, fn, args, kwargs)
        except TypeError as exc:
            replica._engine.refusing("update()", exc)  # on every worker alike
            raise
        if replica.strategy is not strategy:
            raise RuntimeError(
                f"update() of {strategy!r} was called in a replica of {replica.strategy!r}"
            )
        copies: tuple[Any, ...] = await replica._collective(
            _merge_update, (variable, fn, args, kwargs), replica._engine.options._timeout
        )
        return copies
    engine: ReductionEngine = strategy._engine
    async with call_of(engine.cluster, "update()"):
        try:
            args, kwargs = _update_call(variable, fn, args, kwargs)
        except TypeError as exc:
            agreeing = _agreeing(engine)
            if agreeing is not None:
                await agreeing.refuse("update()", exc)  # on every worker alike
            raise
        await _sync_before_replacing(variable)  # fn then reads the chief's value
        return await _update(strategy, variable, fn, args, kwargs)


def _update_call(
    variable: Any, fn: Any, args: Any, kwargs: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``update``'s arguments checked: the positional ones as a tuple, the keywords a dict.

    Raises:
        TypeError: ``variable`` is no variable; ``fn`` is not callable or is async; ``args``
            is not iterable, or ``kwargs`` not a mapping.
    """
    if not isinstance(variable, Variable):
        raise TypeError(f"update() needs an aioreplica.Variable, got {type(variable).__name__}")
    if not callable(fn):
        raise TypeError(f"update() needs a callable fn, got {type(fn).__name__}")
    if inspect.iscoroutinefunction(fn):
        raise TypeError(
            f"update() of variable {variable._name!r}: fn {fn!r:.60} is async; {_PLAIN_FN}"
        )
    if not isinstance(args, list | tuple):
        raise TypeError(
            f"update() of variable {variable._name!r}: args must be a tuple of fn's "
            f"positional arguments, got {type(args).__name__} {args!r:.60}"
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(
            f"update() of variable {variable._name!r}: kwargs must be a mapping of fn's "
            f"keyword arguments or None, got {type(kwargs).__name__} {kwargs!r:.60}"
        )
    return tuple(args), dict(kwargs or {})


async def _merge_update(
    strategy: Any,
    variable: Any,
    fn: Any,
    args: Any,
    kwargs: Any,
) -> tuple[Any, ...]:
    try:
        variable = agreed(variable, "the variable to update")
        fn = agreed(fn, "the update function")
    except ReplicaSyncError as exc:
        await strategy._engine.refuse("update()", exc)  # on every worker alike
        raise
    return await _update(strategy, variable, fn, args, kwargs, in_replicas=True)


MERGE_CALLS[_merge_write] = "a write of a variable (assign, assign_add or assign_sub)"
MERGE_CALLS[_merge_update] = "extended.update of a variable"


async def _update(
    strategy: Any,
    variable: Variable,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    in_replicas: bool = False,
) -> tuple[Any, ...]:
    """``update`` in cross-replica context (``in_replicas``: the merge of one the replicas
    made): every copy computed, then all committed.

    Across workers, outside a ``run()``, a mirrored variable takes the chief's new value on
    every worker, as a write does: ``fn``'s results are broadcast from the chief before any
    copy changes. From the replicas of a ``run()``, every worker must compute the same bits,
    as a write without aggregation must pass them: else every worker raises and nothing
    changes. Either way, arguments refused on one worker are refused on every worker.
    """
    # None: the update is this worker's own (see _writing_as_the_chief).
    engine = _writing_as_the_chief(variable) if isinstance(variable, MirroredVariable) else None
    what = f"update() of variable {variable._name!r}"

    def apply(copy: Any, selected: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        try:
            result = fn(copy, *selected[0], **selected[1])
        except AttributeError as exc:
            if exc.name in ("assign", "assign_add", "assign_sub"):
                add_note(
                    exc,
                    "update()'s fn gets each copy's value (an array) and returns the copy's "
                    "new value, where TF's assigns to a component variable: write "
                    "`lambda v, g: v - g` for TF's `lambda v, g: v.assign_sub(g)`",
                )
            raise
        return _as_copy(variable, result, copy)

    async with variable._turn:
        try:
            per_copy_args = await _update_arguments(strategy, variable, args, kwargs)
            new = await compute_update(variable, apply, per_copy_args)
        except Exception as exc:  # bad arguments, or whatever fn raised
            # The others learn of it too: a refusal they raise in step. (In a run(), what else
            # fn raises fails this worker's run(), as a replica's exception does.)
            shown = exc if isinstance(exc, TypeError | ValueError | RuntimeError) else None
            if engine is not None:
                await engine.refuse(what, shown or ValueError(f"fn raised {error_line(exc)}"))
            elif in_replicas and shown is not None:
                await strategy._engine.refuse(what, shown)
            raise
        if engine is not None:
            label = f"update() of {variable_label(variable)}"  # compared (names may repeat)
            chief = await engine.broadcast(PerReplica(list(new)), 0, label)
            new = await compute_update(variable, writer(ASSIGN), chief)
        elif in_replicas and isinstance(variable, MirroredVariable):
            await _check_every_worker_computed(strategy._engine, variable, new)
        commit([(variable, new)])
    return new


async def _check_every_worker_computed(
    engine: ReductionEngine, variable: Variable, new: Sequence[Any]
) -> None:
    """Across workers, check that every worker computed the same new copies of ``variable``
    (its copies stay bitwise identical everywhere); nothing to do in one process.

    Raises:
        ValueError: the workers computed different values (on every worker alike).
    """
    workers = engine.cluster
    if workers is None or workers.broken:
        return
    with reductions_for(f"update() of {variable_label(variable)}"):
        differ = (await bits_differ(engine, [new]))[0]
    if differ:
        error = ValueError(
            f"update() of MirroredVariable {variable._name!r} in replica context computed "
            "different values on different workers (fn's arguments, or fn itself, differ "
            "between them), but a mirrored variable's copies stay equal on every worker; "
            "pass the same arguments on every worker, or reduce them first"
        )
        await engine.refuse("update()", error)  # every worker raises alike
        raise error


def _call(variable: Variable, what: str) -> contextlib.AbstractAsyncContextManager[None]:
    """Across workers, a write of ``variable`` as one call (``ReductionEngine.call``), held
    before the variable's turn: a first sync and the write's collective never interleave
    with another task's call. In one process, a write in a replica enters nothing: inside a
    replica no call is a checkpoint (a merge round needs every replica)."""
    engine = variable._engine
    cluster = engine.cluster if engine is not None else None
    if cluster is None and context_state.get().replica is not None:
        return _IN_REPLICA
    return call_of(cluster, what)


#: What a write in a replica of a one-process strategy holds: nothing (reentrant).
_IN_REPLICA: Final = contextlib.nullcontext()


def _writing_as_the_chief(variable: Variable) -> ReductionEngine | None:
    """The engine through which a cross-replica write of ``variable`` takes the chief's value
    (``_agreeing``)."""
    return _agreeing(variable._engine)


def _agreeing(engine: ReductionEngine | None) -> ReductionEngine | None:
    """``engine``, where a call outside a step makes its collectives with the other workers
    (and refuses its arguments on every worker): across workers, outside a ``run()``'s step,
    while the workers are in step; else ``None`` (one process, a ``merge_fn``, a broken
    cluster: the call is this worker's own)."""
    workers = engine.cluster if engine is not None else None
    if workers is None or workers.broken or workers.in_step:
        return None
    return engine


def check_updated_by(strategy: Any, variable: Variable) -> None:
    """Refuse ``variable`` given to ``strategy``'s ``extended.update`` when it belongs to
    another strategy (an ordinary variable, of none, is updated as it is).

    Raises:
        ValueError: naming the variable and both strategies.
    """
    owner = variable._strategy
    if owner is not None and owner is not strategy:
        raise ValueError(
            f"update() of {strategy!r} was given variable {variable._name!r}, which belongs "
            f"to {owner!r}; update it through its own strategy"
        )


async def _update_arguments(
    strategy: Any, variable: Variable, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """``update``'s arguments for each copy of ``variable``, as TF selects them: a
    sync-on-read variable's copy ``i`` gets replica ``i``'s component of each distributed
    argument; a mirrored variable's copies, which stay equal, take ``PerReplica`` arguments
    only when every replica's component is equal (made in each replica alike, say). Each
    copy's array arguments are on its device (as TF runs ``fn`` under ``ops.device``): a NumPy
    array is copied to a GPU, an array of another GPU copied in order with the work that
    made it, an array passed twice copied once; a host copy's arguments stay as they are.

    Raises:
        ValueError: ``variable`` belongs to another strategy; a distributed argument holds
            another number of values than the variable has copies.
        TypeError: a mirrored variable's argument is a ``PerReplica`` whose components differ.
    """
    check_updated_by(strategy, variable)
    copies = len(variable._devices)
    named = [
        (f"{where}{format_path(path)}", leaf)
        for where, arguments in (("args", args), ("kwargs", kwargs))
        for path, leaf in flatten_with_path(arguments)[0]
        if isinstance(leaf, DistributedValues)
    ]
    for where, leaf in named:
        if len(leaf.values) != copies:
            raise ValueError(
                f"update() of variable {variable._name!r}: {where} is a {type(leaf).__name__} "
                f"of {len(leaf.values)} values, but the variable has {copies} copies here"
            )
    if not isinstance(variable, SyncOnReadVariable):
        for where, leaf in named:
            if isinstance(leaf, PerReplica) and not await _equal_components(variable, leaf):
                raise TypeError(
                    f"update() of variable {variable._name!r}: {where} is a PerReplica whose "
                    "values differ between replicas, but a mirrored variable's copies stay "
                    "equal; pass the same value on every replica (plain, Mirrored, or a "
                    "PerReplica of equal values), or reduce it first"
                )
    parts = [select_replica(i, (args, kwargs)) for i in range(copies)]
    return on_replica_devices(parts, variable._devices, host_data=True)


async def _equal_components(variable: Variable, leaf: PerReplica[Any]) -> bool:
    """Whether every replica's component of ``leaf`` equals the first's (NaN equal to NaN).
    Arrays of numbers are compared on their copy's device, where its rule puts work of their
    size, the first one copied there; other values on the host."""
    first = leaf.values[0]
    for component, device in zip(leaf.values[1:], variable._devices[1:], strict=True):
        if component is first:
            continue
        if device.kind != "gpu" and (is_cupy_array(first) or is_cupy_array(component)):
            # GPU arrays for a host copy: their host copies wait for the GPU, so off the loop.
            if not await anyio.to_thread.run_sync(_equal_on_host, first, component):
                return False
            continue
        if not (_numeric_array(first) and _numeric_array(component)):
            if not _equal_on_host(first, component):
                return False
            continue
        if first.shape != component.shape:
            return False
        here, other = device.asarray(first), device.asarray(component)
        if not await _holds(device, here.nbytes + other.nbytes, _equal, here, other):
            return False
    return True


def _equal_on_host(first: Any, other: Any) -> bool:
    """Whether two values' host copies are equal, NaN equal to NaN where their dtype has NaNs
    (on a worker thread where one is a GPU array: its copy waits for its GPU)."""
    first, other = host_array(first), host_array(other)
    try:
        return bool(np.array_equal(first, other, equal_nan=True))
    except TypeError:  # a dtype NaN means nothing to (strings, say)
        return bool(np.array_equal(first, other))


def _numeric_array(value: Any) -> bool:
    """Whether ``value`` is an array of numbers or bools (which a device can compare)."""
    return is_array(value) and value.dtype.kind in "biufc"


def _check_integer_range(array: Any, dtype: np.dtype[Any], what: str) -> None:
    """Refuse integers that ``dtype`` cannot hold, which a cast would wrap around silently.

    Raises:
        ValueError: a value of ``array`` is out of ``dtype``'s range.
    """
    bad = _out_of_range(array, dtype)
    if bad is not None:
        info = np.iinfo(dtype)
        raise ValueError(
            f"cannot write {bad} to {what} of dtype {dtype}, which holds {info.min} to "
            f"{info.max}; the cast would wrap it around"
        )


def _out_of_range(array: Any, dtype: np.dtype[Any]) -> int | None:
    """An integer of ``array`` that the integer ``dtype`` cannot hold, else ``None``."""
    if np.can_cast(array.dtype, dtype, casting="safe"):
        return None  # every value fits
    info = np.iinfo(dtype)
    low, high = int(array.min()), int(array.max())
    if low < info.min:
        return low
    return high if high > info.max else None


#: Why NumPy made an array of objects of a value written or given as numbers, for the
#: errors that refuse it.
_OBJECTS: Final = "(values of mixed types make a NumPy array of objects)"

#: The containers whose items NumPy reads as an array's rows, where a write's value or an
#: initial value may be ragged or hold Python ints.
_SEQUENCES: Final = (list, tuple)

#: What ``use_locking`` may be: TF's write methods default it to ``None``, and Keras passes
#: that on.
_LOCKING: Final = (bool, np.bool_, type(None))

#: What ``read_value`` may be.
_BOOLS: Final = (bool, np.bool_)

#: What ``update``'s ``fn`` must be, for the errors that refuse another.
_PLAIN_FN: Final = (
    "fn must be a plain (not async) function that returns the copy's new value; it runs once "
    "per copy, on the copy's device"
)


def _as_copy(variable: Variable, result: Any, like: Any) -> Any:
    """``update``'s ``fn`` result as a new copy: an owned array of the variable's dtype/shape."""
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()  # never awaited, and no warning that it was not
        raise TypeError(
            f"update() of variable {variable._name!r}: fn returned {type(result).__name__} "
            f"{result!r:.60}; {_PLAIN_FN}"
        )
    xp = array_module(like)
    array = xp.asarray(result)
    if tuple(array.shape) != variable._shape or not np.can_cast(
        array.dtype, variable._dtype, casting="same_kind"
    ):
        raise ValueError(
            f"update() of variable {variable._name!r}: fn returned shape "
            f"{tuple(array.shape)} and dtype {array.dtype}, but the variable has shape "
            f"{variable._shape} and dtype {variable._dtype}; fn must return the copy's new "
            "value"
        )
    return xp.array(array, dtype=variable._dtype, copy=True)


# -- helpers ------------------------------------------------------------------------------


#: The types whose NumPy functions ``Variable.__array_function__`` computes itself.
_COMPUTED_HERE: Final = (Variable, np.ndarray)


def _check_out(out: Any, func: Any) -> None:
    """Refuse a variable as the ``out`` (an array, or a tuple of them) of NumPy's ``func``.

    Raises:
        TypeError: ``out`` is (or holds) a variable.
    """
    outs = out if type(out) is tuple else (out,)
    if any(isinstance(target, Variable) for target in outs):
        raise TypeError(
            f"a variable cannot be the out= of {func.__name__}; variables change only "
            "through `await v.assign(...)`, `assign_add` or `assign_sub`"
        )


def _scope(name: str) -> tuple[Any, ReductionEngine | None]:
    """The strategy a new variable belongs to, with its engine: the enclosing ``scope()``'s,
    or ``(None, None)`` outside any scope (and in the default strategy's). Inside a replica
    ``_shared`` has made the replica's strategy the enclosing one.

    Raises:
        RuntimeError: the enclosing scope (or run) is inside the default strategy's scope, as
            TF refuses it (its default strategy's variable creator runs too).
    """
    state: ContextState = context_state.get()
    if state.strategy is None or state.strategy is default_replica_context().strategy:
        return None, None
    if state.replica is None and default_scope_open.get():
        raise RuntimeError(
            f"variable {name!r} was created for {state.strategy!r} (in its scope or run()) "
            "inside the default strategy's scope; strategies cannot be mixed (TF: \"Mixing "
            'different tf.distribute.Strategy objects"): create it outside the default '
            "strategy's scope"
        )
    return state.strategy, state.engine


def _shared(
    cls: type[Variable], replica: ReplicaContext, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``cls(*args, **kwargs)`` inside ``replica``: the run's variable for this replica's next
    creation (TF's shared variable creator), made in the strategy's scope by the first replica
    to ask for it and checked against what each later one asks for.

    Raises:
        RuntimeError: the replica asks for another variable than the one made for this place
            in the order; the strategy spans several workers.
    """
    name = kwargs.get("name")
    if name is None:
        name = "Variable"
    engine = replica._engine
    where = f"inside replica {replica.replica_id_in_sync_group} of {replica.strategy!r}"
    if engine.cluster is not None:
        error = RuntimeError(
            f"variable {name!r} was created {where}; across workers, create variables in "
            "`with strategy.scope():` outside run(), where every worker starts them from the "
            "chief's value"
        )
        engine.refusing("Variable()", error)  # on every worker alike: the strategy goes on
        raise error
    point = replica._merge_point
    assert point is not None  # only the default context has none, and it is no replica
    creations = point.variable_creations()
    local = replica.local_replica_id
    with creations.lock:
        k = creations.made[local]
        if k < len(creations.variables):
            variable, maker = creations.variables[k]
            initial = args[0] if args else kwargs.get("initial_value")
            trainable = args[1] if len(args) > 1 else kwargs.get("trainable")
            _check_same_creation(cls, variable, maker, replica, k, name, kwargs, initial, trainable)
        else:
            token = context_state.set(ContextState(strategy=replica.strategy, engine=engine))
            try:
                variable = cls(*args, **kwargs)
            finally:
                context_state.reset(token)
            creations.variables.append((variable, replica.replica_id_in_sync_group))
        creations.made[local] = k + 1
    return variable


def _check_same_creation(
    cls: type[Variable],
    variable: Variable,
    maker: int,
    replica: ReplicaContext,
    k: int,
    name: str,
    kwargs: dict[str, Any],
    initial: Any,
    trainable: Any,
) -> None:
    """Refuse a replica's ``k``-th ``Variable(...)`` call that asks for another variable than
    the ``k``-th one ``maker`` made (a name, class, synchronization, aggregation, dtype or
    ``trainable`` of its own, or an initial value of another shape; a callable one is not
    called, so only a ``dtype`` given tells its dtype).

    Raises:
        RuntimeError: naming both replicas and both variables (with the dtypes, or whether
            each is trainable, where those differ).
    """
    sync = _sync_of(kwargs.get("synchronization"))
    agg = _agg_of(kwargs.get("aggregation"))
    on_read = sync is _Sync.ON_READ  # AUTO and ON_WRITE both make a mirrored variable
    try:
        shape = None if callable(initial) else tuple(np.shape(initial))
    except (TypeError, ValueError):  # no shape to tell (a ragged list): creating one would say
        shape = None
    dtype = _asked_dtype(initial, kwargs.get("dtype"))
    same_kind = (variable._synchronization is _Sync.ON_READ) == on_read
    if trainable is None:  # the default follows the synchronization, compared on its own
        trainable = not on_read if same_kind else variable._trainable
    other_trainable = bool(trainable) != variable._trainable
    other_dtype = dtype not in (None, variable._dtype)
    if (
        variable._name == name
        and same_kind
        and variable._aggregation is agg
        and isinstance(variable, cls)
        and shape in (None, variable._shape)
        and not other_dtype
        and not other_trainable
    ):
        return
    of_shape = "" if shape is None else f" of shape {shape}"
    wanted = (
        f"{cls.__name__} {name!r}{of_shape} (synchronization {sync.name}, aggregation "
        f"{agg.name}{f', dtype {dtype}' if other_dtype else ''}"
        f"{f', trainable {bool(trainable)}' if other_trainable else ''})"
    )
    made = (
        f"{type(variable).__name__} {variable._name!r} of shape {variable._shape} "
        f"(synchronization {variable._synchronization.name}, aggregation "
        f"{variable._aggregation.name}{f', dtype {variable._dtype}' if other_dtype else ''}"
        f"{f', trainable {variable._trainable}' if other_trainable else ''})"
    )
    raise RuntimeError(
        f"replica {replica.replica_id_in_sync_group} asked for {wanted} as its variable "
        f"#{k + 1} in this run, but replica {maker} made {made} as its #{k + 1}; the replicas "
        "of a run share their variables, so every replica must create the same variables in "
        "the same order"
    )


def _check_shape(shape: Any, initial: tuple[int, ...], name: str) -> None:
    """Refuse a ``shape`` argument that is not the initial value's shape (a variable's shape
    never changes).

    Raises:
        TypeError: ``shape`` is not an int or a sequence of ints.
        ValueError: it differs from the initial value's shape.
    """
    dims = (shape,) if isinstance(shape, int | np.integer) else shape
    try:
        wanted = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise TypeError(
            f"variable {name!r}: shape must be an int, a sequence of ints or None, got "
            f"{shape!r:.60}"
        ) from None
    if wanted != initial:
        raise ValueError(
            f"variable {name!r}: shape {wanted} was given, but the initial value has shape "
            f"{initial}; pass an initial value of that shape (np.broadcast_to(value, shape)), "
            "or leave shape out"
        )


def _asked_dtype(initial: Any, dtype: Any) -> np.dtype[Any] | None:
    """The dtype a ``Variable(initial, dtype=dtype)`` call asks for, as the constructor
    takes it (``dtype`` if given, else the initial value's own), or ``None`` where that cannot
    be told without making it (a callable initial value, an invalid dtype: creating one would
    say)."""
    if dtype is None and callable(initial):
        return None
    if dtype is None:  # an array's, a variable's or a NumPy scalar's own, else NumPy's guess
        dtype = getattr(initial, "dtype", None)
    try:
        asked: np.dtype[Any] = np.dtype(dtype if dtype is not None else np.asarray(initial).dtype)
    except (TypeError, ValueError):
        return None
    return asked


def _check_kind(
    cls: type[Variable],
    strategy: Any,
    sync: VariableSynchronization,
    agg: VariableAggregation,
    name: str,
) -> None:
    if strategy is None:
        if cls is not Variable:
            raise ValueError(
                f"{cls.__name__} {name!r} must be created inside `with strategy.scope():`; "
                "outside a scope, use aioreplica.Variable for an ordinary variable"
            )
        return
    if sync is _Sync.NONE:
        raise ValueError(
            f"variable {name!r}: synchronization NONE is not allowed in {strategy!r}'s scope, "
            "where every variable has a copy per replica; use synchronization='on_write' "
            "(a MirroredVariable, the default) or 'on_read' (a SyncOnReadVariable)"
        )
    wants = SyncOnReadVariable if sync is _Sync.ON_READ else MirroredVariable
    if cls is not wants:
        raise ValueError(
            f"{cls.__name__} {name!r} cannot have synchronization {sync.name}; use "
            f"aioreplica.Variable, which makes a {wants.__name__} for it"
        )


def _initial_array(value: Any, dtype: Any, name: str) -> Any:
    """A fresh array of ``value`` (never the caller's own object), in ``dtype`` if given.

    ``dtype`` casts the value by a write's rules: an array (or a NumPy scalar) of another
    dtype kind is refused, as is an integer the dtype cannot hold; Python numbers, which have
    no dtype of their own, take it where they fit (an int into any integer, float or complex
    dtype, and ``0``/``1`` into bool; a float into a float or complex dtype).

    Raises:
        TypeError: ``value`` is not numeric or bool, ``dtype`` is not a numeric or bool NumPy
            dtype, or the cast would drop a fraction or an imaginary part.
        ValueError: ``dtype`` cannot hold an integer of ``value``.
    """
    if isinstance(value, Variable):
        value = value.value()
    target = None if dtype is None else _target_dtype(dtype, name)
    if is_cupy_array(value):
        with value.device:  # copied on the GPU it is on, on that GPU's current stream
            if target is not None:
                _check_initial_cast(value, target, name, own_dtype=True)
            array = array_module(value).array(value, dtype=target, copy=True)
    elif is_array(value):
        if target is not None:
            _check_initial_cast(value, target, name, own_dtype=True)
        array = np.array(value, dtype=target, copy=True)
    else:
        try:
            array = np.array(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"variable {name!r}: cannot make an array of the initial value "
                f"{type(value).__name__} {value!r:.60}: {exc}"
            ) from None
        if array.dtype == object:  # not an array the caller made of objects: say why
            if target is not None and target.kind in "fc" and _int_beyond_int64(value):
                # an int beyond 64 bits into a float or complex dtype, as any int goes
                with contextlib.suppress(TypeError, ValueError, OverflowError):
                    return np.array(value, dtype=target)
            _check_big_ints(value, target, name)
            raise TypeError(
                f"variable {name!r}: the initial value has dtype object; variables hold numeric "
                f"or bool arrays, and {value!r:.60} is no array of numbers {_OBJECTS}"
            )
        if target is None and not isinstance(value, np.generic):
            _check_python_ints(value, array, name)
        if target is not None:
            own = isinstance(value, np.generic)  # a NumPy scalar has its dtype, as an array
            _check_initial_cast(array, target, name, own_dtype=own)
            array = array.astype(target)
    if array.dtype.kind not in "biufc":
        if array.dtype == object:  # an array of objects the caller made: big ints, say
            _check_big_ints(array, target, name)
        raise TypeError(
            f"variable {name!r}: the initial value has dtype {array.dtype}; variables hold "
            "numeric or bool arrays"
        )
    return array


def _check_big_ints(value: Any, target: np.dtype[Any] | None, name: str) -> None:
    """Refuse an initial value holding a Python int beyond 64 bits, which NumPy keeps as an
    object, for no ``dtype`` or an integer one (``target``).

    Raises:
        ValueError: naming the int and the dtypes that cannot hold it.
    """
    big = _int_beyond_int64(value)
    if big is None:
        return
    held = "no NumPy integer dtype" + ("" if target is None else f", nor dtype {target}")
    raise ValueError(
        f"variable {name!r}: the initial value {big} fits {held} (int64 holds {INT64_MIN} to "
        f"{INT64_MAX}, uint64 0 to {2**64 - 1}); pass it as a float if an approximation "
        "will do"
    )


def _check_python_ints(value: Any, array: np.ndarray[Any, Any], name: str) -> None:
    """Refuse an initial value (``array``: NumPy's array of it, no dtype asked) holding a
    Python int beyond int64: NumPy makes it uint64 (or float64), where later writes wrap
    around or lose digits; TF refuses it too (an out-of-range integer).

    Looked for only where such an int can hide: NumPy made unsigned integers (where it
    wraps around), or floats (complex) of a value whose first number is an int, of which TF
    makes an integer tensor (it takes the dtype from the first number). A value whose first
    number is a float is a float tensor in TF too, and is not walked: a long list of floats
    would cost far more here than making its array.

    Raises:
        ValueError: naming the int and what to pass instead.
    """
    kind = array.dtype.kind
    if kind not in "ufc" or not array.size:
        return
    if kind != "u" and not _is_python_int(_first_number(value)):
        return
    big = _int_beyond_int64(value)
    if big is not None:
        raise ValueError(
            f"variable {name!r}: the initial value {big} does not fit int64, which holds "
            f"{INT64_MIN} to {INT64_MAX} and is the dtype Python ints make; NumPy would make "
            f"it {array.dtype}, where writes wrap around or lose digits: pass the dtype "
            "that holds it (e.g. dtype='uint64')"
        )


def _first_number(value: Any) -> Any:
    """The first item of ``value`` that is no list or tuple (``value`` itself if it is none);
    an empty list or tuple if it meets one first."""
    while isinstance(value, _SEQUENCES) and value:
        value = value[0]
    return value


def _is_python_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_beyond_int64(value: Any) -> int | None:
    """The first Python int outside int64 in ``value`` (an int, nested lists and tuples, or
    a NumPy array of objects), or ``None``."""
    if _is_python_int(value):
        return None if INT64_MIN <= value <= INT64_MAX else value
    if isinstance(value, np.ndarray) and value.dtype == object:
        value = value.flat
    if isinstance(value, (*_SEQUENCES, np.flatiter)):
        for item in value:
            found = _int_beyond_int64(item)
            if found is not None:
                return found
    return None


def _target_dtype(dtype: Any, name: str) -> np.dtype[Any]:
    """``dtype`` as a NumPy dtype a variable can hold, or a clear error.

    Raises:
        TypeError: ``dtype`` is no NumPy dtype, or not a numeric or bool one.
    """
    try:
        target: np.dtype[Any] = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"variable {name!r}: dtype {dtype!r} is not a NumPy dtype: {exc}") from None
    if target.kind not in "biufc":
        raise TypeError(
            f"variable {name!r}: dtype {target} is not numeric or bool; variables hold "
            "numeric or bool arrays"
        )
    return target


def _check_initial_cast(array: Any, dtype: np.dtype[Any], name: str, *, own_dtype: bool) -> None:
    """Refuse to make ``array`` (the initial value; ``own_dtype``: whether the caller gave it
    a dtype, or Python numbers inferred it) a variable of ``dtype`` where a write would
    refuse the value: another dtype kind, or an integer ``dtype`` cannot hold.

    Raises:
        TypeError: the cast would change the kind of the values (a float to an integer, a
            complex to a float, anything numeric to bool, text or dates to numbers).
        ValueError: an integer out of ``dtype``'s range.
    """
    kind = array.dtype.kind
    if kind not in "biufc":
        raise TypeError(
            f"variable {name!r}: the initial value has dtype {array.dtype}; variables hold "
            "numeric or bool arrays"
        )
    if not own_dtype and not array.size:
        return  # no numbers (``[]``): the dtype NumPy guessed means nothing
    if kind == "b" and dtype.kind != "b":
        raise TypeError(
            f"variable {name!r}: an initial value of dtype bool cannot make a variable of "
            f"dtype {dtype}: bools are no numbers (as in TF, and a write refuses them too); "
            f"cast it first (e.g. np.asarray(value).astype({dtype}))"
        )
    python_int = not own_dtype and kind in "iu"  # Python ints take any integer dtype or bool
    if not np.can_cast(array.dtype, dtype, casting="same_kind") and not (
        python_int and dtype.kind in "iub"
    ):
        value = "value" if own_dtype else "np.asarray(value)"
        raise TypeError(
            f"variable {name!r}: an initial value of dtype {array.dtype} does not cast to "
            f"dtype {dtype} without losing its kind of number (a write refuses it too); cast "
            f"it first (e.g. {value}.astype({dtype}))"
        )
    if not array.size or kind not in "iu":
        return
    if dtype.kind == "b":
        low, high = int(array.min()), int(array.max())
        if low < 0 or high > 1:
            raise ValueError(
                f"variable {name!r}: the initial value {low if low < 0 else high} does not "
                "fit dtype bool, which holds 0 (False) and 1 (True); pass bools, or compare "
                "first (value != 0)"
            )
    elif dtype.kind in "iu":
        bad = _out_of_range(array, dtype)
        if bad is not None:
            info = np.iinfo(dtype)
            raise ValueError(
                f"variable {name!r}: the initial value {bad} does not fit dtype {dtype}, which "
                f"holds {info.min} to {info.max}; the cast would wrap it around: choose a "
                "wider dtype"
            )


def _check_aggregation_dtype(
    agg: VariableAggregation, dtype: np.dtype[Any], name: str, on_read: bool
) -> None:
    """Refuse an aggregation the dtype cannot hold: a sync-on-read variable's mean of its
    copies (a mirrored one's ``MEAN`` takes integers as TF does: the one value every replica
    writes), a sum of bools."""
    if on_read and agg is _Agg.MEAN and dtype.kind not in "fc":
        raise TypeError(
            f"sync-on-read variable {name!r} of dtype {dtype} cannot have aggregation MEAN, "
            "whose result is fractional; use a floating dtype, or aggregation 'sum'"
        )
    if agg is _Agg.SUM and dtype.kind == "b":
        raise TypeError(
            f"variable {name!r} of dtype bool cannot have aggregation SUM; use an integer "
            "dtype to count"
        )
