"""Distributed input: global batches split across replicas, prefetched, never hanging.

``strategy.distribute_dataset(dataset)`` turns an iterable (or async iterable) of global batches
into an async iterable of per-replica batches (users' guide: README.md, "Distributed input"):

- **split**: each global batch of B rows is cut along axis 0 into one slice per replica, sizes
  differing by at most one, larger slices first, in replica order. Host slices are read-only
  views (a step's in-place edit cannot reach the dataset's arrays); each slice is placed with
  its replica's ``device.asarray`` (an asynchronous copy on its stream for a GPU). An element
  is ``regroup`` of the replicas' slices. The arrays an iterator yields are copied as they
  come, with or without prefetching: it may refill the same buffer while earlier elements are
  still in use (by a step, a batch pulled ahead, or a caller's own pull of the next element
  while a step runs); in-memory data, pulled inline, is never refilled. The copies are made
  off the event loop: on the loader thread as part of its pull, else on a
  worker thread once they are big enough to take longer than the hop (``_owned_off_loop``).
  So is the one copy in-memory data makes, a shuffled ``batched`` batch gathered from its
  rows (``_next_batch``).
- **drop_remainder**: a global batch smaller than the first is dropped only if it is the
  last; one in the middle of the data is split as any other (the next batch is pulled to
  tell, so that batch is pulled ahead of its element even with ``prefetch=0``).
- **uneven ends**: replicas that get no rows of the last batch get zero-length arrays of the
  right trailing shape and dtype, so every replica takes the same number of steps and none waits
  forever; iteration ends when the dataset does.
- **prefetch**: up to ``prefetch`` elements are pulled, split and placed ahead in a background
  task owned by the iterator. It ends when the iteration ends, ``break``s (the iterator is
  dropped) or is cancelled, closing the dataset: a new pass over a one-shot iterator (a
  generator) is then empty, where with ``prefetch=0`` it goes on from where the break left.
  It runs in a copy of the context of the task that started the pass, on every loop. When
  its event loop ends first, the iterator hands out what it had prefetched, then raises
  ``RuntimeError`` at every later wait.
- **synchronous loaders**: a synchronous dataset (other than lists, tuples and ``batched``,
  which never block and are pulled inline) is pulled on a daemon thread of its own, one call at
  a time, from the ``iter()`` that starts each pass on, so a slow loader (or a slow start: a
  data loader starting its workers, a reader opening its files) never blocks the event loop
  and cancellation never waits for it (an async dataset's ``aiter()`` stays on the loop: it
  must not block). The thread belongs to the iterator, or to the dataset for a one-shot
  iterator such as a generator, which every pass shares. A wait given up (a timeout, a
  cancelled task, leaving ``async with``, the loop ending) returns at once while the pull runs
  on, and no pull starts beside it; the item it makes goes to the next pull asked for (with
  ``prefetch > 0`` a given-up wait ends the iteration instead: see ``DistributedIterator``).
  A loader that never returns keeps its thread blocked for good, but not the process (a
  daemon thread), and every later wait on it waits for it (cancellably); closing the iterator
  then returns at once, and the loader is closed after that pull, if it ever ends.
- **async only**: ``for`` over a distributed dataset or its iterator is a ``TypeError`` that
  says to use ``async for``.
- **input pipelines**: each input pipeline takes its own contiguous part of every global batch
  (``InputContext``). With one process there is one pipeline.
- **resumable**: an iterator over a ``batched`` dataset can be saved in a ``Checkpoint``. Its
  position is what it has handed out, not what it has prefetched: the puller notes the
  dataset's position as it makes each element, and the iterator takes that note as it hands
  the element on. Restored into a fresh iterator over the same dataset, it continues with the
  next element (see ``aioreplica._batched`` for what is saved).
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import inspect
import itertools
import pickle
import queue
import threading
import weakref
import zlib
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, NoReturn, SupportsIndex, TypeVar, final

import anyio
import numpy as np

from . import _loops, _trace, _tree
from ._backends import host_array, is_array
from ._batched import BatchedIterator, batch_rows, batched
from ._cluster import WorkersDisagree, error_line, worker_list
from ._errors import ReplicaSyncError, as_integer, checked_integer
from ._options import CaseInsensitiveStrEnum
from ._values import PerReplica, regroup

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterable, Sequence
    from types import TracebackType

    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

    from ._backends import Device
    from ._cluster import Workers

__all__ = [
    "DistributedDataset",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "OptionalValue",
    "ValueContext",
    "interleaved",
]

T = TypeVar("T")

_END: Final = object()
#: What ``interleaved`` gives for a dataset that ended while others still have data: the
#: replica gets an empty batch.
_NO_BATCH: Final = object()
#: A worker's mark in a pass's agreement when its dataset raised.
_RAISED: Final = -1
#: What a pass's agreement on its next batch is called in waits and errors (a worker late to
#: it, or that left the pass early, is named for it).
_NEXT_BATCH: Final = "a dataset pass's agreement on its next batch"
#: How many rows of each leaf of a global batch, and how many values of each, its fingerprint
#: takes (``_fingerprint``).
_SAMPLED_ROWS: Final = 16
_SAMPLED_VALUES: Final = 8
#: The dtype kinds whose bytes the fingerprint takes: numbers, dates, fixed-width strings.
_SAMPLED_KINDS: Final = "biufcmMSU"
#: The bytes of a long double that hold its value, the first ones in native byte order: 10
#: for x87's 80-bit format (stored in 12 or 16 bytes), all of them otherwise (IEEE quad, or
#: a long double that is a double).
_LONG_DOUBLE_VALUE_BYTES: Final = (
    10 if np.finfo(np.longdouble).nmant == 63 else np.dtype(np.longdouble).itemsize
)
#: The bytes of an item's host arrays below which ``_owned_off_loop`` copies them on the event
#: loop: a copy of 1 MiB takes 0.05-0.1 ms, less than the hop to a worker thread and back
#: (0.1-0.2 ms, measured on asyncio and trio), and blocks the loop no longer than that; past
#: 2 MiB the copy takes longer than the hop, and grows with the arrays (some 40-600 ms for a
#: 128 MiB batch).
_COPIED_INLINE_BYTES: Final = 1 << 20


# -- contexts ----------------------------------------------------------------------------


@final
@dataclass(frozen=True, slots=True)
class InputContext:
    """What an input function needs to know about where its data goes, as in TF.

    Attributes:
        num_input_pipelines: how many input pipelines (one per worker) feed the replicas.
        input_pipeline_id: this pipeline's number, from 0.
        num_replicas_in_sync: replicas over all pipelines.

    Raises:
        TypeError: a field is not an int.
        ValueError: a count is below 1, or ``input_pipeline_id`` is not below
            ``num_input_pipelines``.

    Example:
        >>> InputContext(num_replicas_in_sync=4).get_per_replica_batch_size(64)
        16
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        pipelines = checked_integer(
            self.num_input_pipelines, "InputContext: num_input_pipelines must be an int >= 1", 1
        )
        replicas = checked_integer(
            self.num_replicas_in_sync, "InputContext: num_replicas_in_sync must be an int >= 1", 1
        )
        pipeline = checked_integer(
            self.input_pipeline_id,
            f"InputContext: input_pipeline_id must be an int from 0 to {pipelines - 1} (one "
            f"of its {pipelines} input pipelines)",
            0,
            pipelines - 1,
        )
        object.__setattr__(self, "num_input_pipelines", pipelines)
        object.__setattr__(self, "input_pipeline_id", pipeline)
        object.__setattr__(self, "num_replicas_in_sync", replicas)

    def __str__(self) -> str:
        # TF's wording; the repr names every field.
        return (
            f"InputContext(input pipeline id {self.input_pipeline_id}, "
            f"total: {self.num_input_pipelines})"
        )

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The per-replica batch size for ``global_batch_size``.

        Raises:
            ValueError: ``global_batch_size`` is negative, or not divisible by the number of
                replicas.
            TypeError: ``global_batch_size`` is not an int.

        Example:
            >>> InputContext(num_replicas_in_sync=2).get_per_replica_batch_size(8)
            4
        """
        global_batch_size = checked_integer(
            global_batch_size, "global_batch_size must be an int >= 0", 0
        )
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"the global batch size {global_batch_size} is not divisible by the "
                f"{self.num_replicas_in_sync} replicas in sync; choose a multiple of "
                f"{self.num_replicas_in_sync}"
            )
        return global_batch_size // self.num_replicas_in_sync


class InputReplicationMode(CaseInsensitiveStrEnum):
    """How input pipelines feed a worker's replicas, as TF's ``InputReplicationMode``.

    ``PER_WORKER``: one pipeline per worker feeds all its replicas. ``PER_REPLICA``: one
    pipeline per replica (``distribute_datasets_from_function`` only).

    Example:
        >>> InputReplicationMode.parse("PER_REPLICA")
        <InputReplicationMode.PER_REPLICA: 'per_replica'>
    """

    PER_WORKER = "per_worker"
    PER_REPLICA = "per_replica"


@final
@dataclass(frozen=True, slots=True)
class InputOptions:
    """How a distributed dataset feeds the replicas, as TF's ``tf.distribute.InputOptions``.

    Attributes:
        experimental_fetch_to_device: place each replica's data on its device (``None``:
            yes, unless ``experimental_place_dataset_on_device``); ``False`` leaves it as the
            dataset made it (host arrays stay on the host).
        experimental_replication_mode: an ``InputReplicationMode`` or its name.
        experimental_place_dataset_on_device: TF's placing of each replica's pipeline on its
            device, which needs ``PER_REPLICA`` and no fetching; here the replica's data is
            placed on its device as it is made.
        experimental_per_replica_buffer_size: elements made ahead (the ``prefetch`` of the
            dataset functions, when they are not given one).

    Raises:
        ValueError: an unknown replication mode; a negative buffer size; placing the dataset
            on the device with ``PER_WORKER``, or with ``experimental_fetch_to_device=True``
            (as in TF).
        TypeError: a flag that is not a bool, or a buffer size that is not an int.

    Example:
        >>> InputOptions(experimental_fetch_to_device=False).experimental_per_replica_buffer_size
        1
    """

    experimental_fetch_to_device: bool | None = None
    experimental_replication_mode: InputReplicationMode | str = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1

    def __post_init__(self) -> None:
        mode = InputReplicationMode.parse(self.experimental_replication_mode)
        object.__setattr__(self, "experimental_replication_mode", mode)
        fetch = self.experimental_fetch_to_device
        place = self.experimental_place_dataset_on_device
        if fetch is not None and not isinstance(fetch, bool):
            raise TypeError(f"experimental_fetch_to_device must be a bool or None, got {fetch!r}")
        if not isinstance(place, bool):
            raise TypeError(f"experimental_place_dataset_on_device must be a bool, got {place!r}")
        size = as_integer(self.experimental_per_replica_buffer_size)
        if size is None:
            raise TypeError(
                "experimental_per_replica_buffer_size must be an int, got "
                f"{self.experimental_per_replica_buffer_size!r}"
            )
        if size < 0:
            raise ValueError(f"experimental_per_replica_buffer_size must be >= 0, got {size}")
        object.__setattr__(self, "experimental_per_replica_buffer_size", size)
        if place and mode is InputReplicationMode.PER_WORKER:
            raise ValueError(
                "experimental_place_dataset_on_device=True needs "
                "experimental_replication_mode=InputReplicationMode.PER_REPLICA, as in TF"
            )
        if place and fetch:
            raise ValueError(
                "experimental_place_dataset_on_device=True cannot go with "
                "experimental_fetch_to_device=True, as in TF: leave fetching unset or False"
            )

    @property
    def _placed(self) -> bool:
        """Whether each replica's data goes to its device."""
        fetch = self.experimental_fetch_to_device
        return self.experimental_place_dataset_on_device or fetch is None or fetch


def interleaved(datasets: Sequence[Any]) -> Any:
    """One element of each of ``datasets`` in turn (a round per replica, for
    ``PER_REPLICA`` input), while any of them has one: a dataset that ended gives
    ``_NO_BATCH`` in the rounds that others fill (its replica gets empty batches). An
    iterable, or an async iterable when any of them is asynchronous (which pulls the others
    that may block on loader threads), whose every pass starts the datasets over (a list's
    every epoch, as for one dataset).

    Raises:
        TypeError: a dataset is not iterable, or is a string, an array or a mapping (its items
            are characters, rows or keys, not batches), or is a coroutine (then every
            coroutine among ``datasets`` is closed).
    """
    try:
        for dataset in datasets:
            check_iterable(dataset)
    except TypeError:
        for dataset in datasets:
            if inspect.iscoroutine(dataset):
                dataset.close()  # no "never awaited" warning for the others either
        raise
    if any(hasattr(dataset, "__aiter__") for dataset in datasets):
        return _AsyncInterleaved(datasets)
    return _Interleaved(datasets)


def check_iterable(dataset: Any) -> None:
    """Refuse a dataset that cannot be iterated, or whose items are characters.

    Raises:
        TypeError: ``dataset`` is neither iterable nor async iterable, is a string, an array
            or a mapping, or is a coroutine (which is closed: what an ``async def`` dataset
            function returns).
    """
    if inspect.iscoroutine(dataset):
        dataset.close()
        raise TypeError(
            "a dataset must be an iterable or async iterable of batches, got a coroutine: "
            "dataset_fn must return the dataset, so make it a plain function, not a coroutine "
            "function (an async generator, or a function returning one, is a dataset)"
        )
    refuse_characters(dataset)
    refuse_array(dataset)
    refuse_mapping(dataset)
    if not (hasattr(dataset, "__aiter__") or hasattr(dataset, "__iter__")):
        raise TypeError(
            f"a dataset must be an iterable or async iterable of batches, got "
            f"{type(dataset).__name__}"
        )


def refuse_array(dataset: Any) -> None:
    """Refuse an array as a dataset: it iterates as rows, each of which would be cut across
    the replicas as if it were a batch.

    Raises:
        TypeError: ``dataset`` is a NumPy or CuPy array.
    """
    if is_array(dataset):
        raise TypeError(
            f"a dataset must be an iterable or async iterable of batches, got a "
            f"{type(dataset).__module__.partition('.')[0]}.ndarray of shape {dataset.shape}, "
            "whose items are its rows, not batches; pass a list of batches (for example "
            "list(np.array_split(x, number_of_batches))) or aioreplica.batched(x, batch_size)"
        )


def refuse_mapping(dataset: Any) -> None:
    """Refuse a mapping as a dataset: it iterates as its keys (TF's
    ``from_tensor_slices({...})`` habit, which cuts its arrays into rows, does not carry over).
    A mapping class of the program's that iterates in its own way (its own ``__iter__``, or
    an ``__aiter__``) is a dataset like any other.

    Raises:
        TypeError: ``dataset`` is a ``Mapping`` (a dict of arrays, say) that iterates as a
            standard mapping does.
    """
    if isinstance(dataset, Mapping) and _iterates_as_keys(type(dataset)):
        raise TypeError(
            f"a dataset must be an iterable or async iterable of batches, got "
            f"{_tree.with_article(type(dataset).__name__)} with keys "
            f"{_tree.short_repr(list(dataset))}, whose items are its keys, not batches; to cut "
            "a dict of arrays into batches pass aioreplica.batched({...}, batch_size) (what "
            "tf.data's from_tensor_slices({...}).batch(batch_size) makes), or pass a list of "
            "dict batches"
        )


def _iterates_as_keys(cls: type) -> bool:
    """Whether a mapping of class ``cls`` iterates as its keys: it has no ``__aiter__``, and
    its ``__iter__`` comes from a standard mapping (``dict``, the ``collections`` ones,
    ``types.MappingProxyType``), not from a class of the program's."""
    if hasattr(cls, "__aiter__"):
        return False
    for klass in cls.__mro__:
        if "__iter__" in vars(klass):
            return klass.__module__ in _STANDARD_MODULES
    return True


#: The modules of the standard mappings, whose ``__iter__`` gives their keys.
_STANDARD_MODULES: Final = frozenset({"builtins", "collections", "types", "_collections_abc"})


def refuse_characters(dataset: Any) -> None:
    """Refuse a string as a dataset: it iterates as characters, not batches.

    Raises:
        TypeError: ``dataset`` is a ``str``, ``bytes`` or ``bytearray``.
    """
    if isinstance(dataset, str | bytes | bytearray):
        raise TypeError(
            "a dataset must be an iterable or async iterable of batches, got the "
            f"{type(dataset).__name__} {dataset!r:.60}, whose items are characters, not "
            "batches; pass a list of batches or aioreplica.batched(array, batch_size)"
        )


@final
class _Interleaved:
    __slots__ = ("_datasets",)

    def __init__(self, datasets: Sequence[Any]) -> None:
        self._datasets = tuple(datasets)

    def __iter__(self) -> Iterator[Any]:
        return _interleaved(self._datasets)


@final
class _AsyncInterleaved:
    __slots__ = ("_datasets",)

    def __init__(self, datasets: Sequence[Any]) -> None:
        self._datasets = tuple(datasets)

    def __aiter__(self) -> AsyncIterator[Any]:
        return _InterleavedAsync(self._datasets)


def _interleaved(datasets: Sequence[Any]) -> Iterator[Any]:
    iterators = [iter(dataset) for dataset in datasets]
    ended = [False] * len(iterators)
    try:
        while True:  # a round is pulled whole: it is given only if any dataset had an item
            round_ = [
                _NO_BATCH if done else next(it, _END)
                for it, done in zip(iterators, ended, strict=True)
            ]
            ended = [item is _END or item is _NO_BATCH for item in round_]
            if all(ended):
                return
            yield from (_NO_BATCH if item is _END else item for item in round_)
    finally:  # the pipelines end with this one (a generator's ``finally`` runs now)
        for iterator in iterators:
            _close(iterator)


@final
class _InterleavedAsync:
    """``_interleaved`` for datasets of which any is asynchronous: an iterator, not an async
    generator, so that a given-up wait (which a cancellation would end an async generator
    with) loses nothing; the round begun stays for the next wait. A synchronous dataset that
    may block is pulled on a loader thread of its own."""

    __slots__ = ("_ended", "_iterators", "_ready", "_round")

    def __init__(self, datasets: Sequence[Any]) -> None:
        self._iterators: list[Any] = [
            _AsyncSource(aiter(d))
            if hasattr(d, "__aiter__")
            else _LoaderThread(d)
            if _pulled_on_a_thread(d)
            else iter(d)
            for d in datasets
        ]
        self._ended = [False] * len(self._iterators)
        self._round: list[Any] = []  # the items of the round being pulled
        self._ready: deque[Any] = deque()  # a round pulled whole, being handed on

    def __aiter__(self) -> _InterleavedAsync:
        return self

    async def __anext__(self) -> Any:
        while not self._ready:
            if all(self._ended):
                raise StopAsyncIteration
            while len(self._round) < len(self._iterators):  # as ``_interleaved``
                index = len(self._round)
                done = self._ended[index]
                self._round.append(_NO_BATCH if done else await _next_of(self._iterators[index]))
            round_, self._round = self._round, []
            self._ended = [item is _END or item is _NO_BATCH for item in round_]
            if not all(self._ended):
                self._ready.extend(_NO_BATCH if item is _END else item for item in round_)
        return self._ready.popleft()

    async def aclose(self) -> None:
        """Close every dataset: the pipelines end with this one. A pull that runs meanwhile
        closes its own dataset as it ends, and gives the end (see ``_AsyncSource``)."""
        self._ended = [True] * len(self._iterators)
        self._ready.clear()
        for iterator in self._iterators:
            if isinstance(iterator, _LoaderThread | _AsyncSource):
                await iterator.close()
            else:
                _close(iterator)


async def _next_of(iterator: Any) -> Any:
    """The next item of an async iterator, a loader thread or an in-memory iterator, or
    ``_END``."""
    if isinstance(iterator, _LoaderThread | _AsyncSource):
        return await iterator.pull()
    return next(iterator, _END)


@final
class _AsyncSource:
    """An async iterator's items, one at a time. A wait given up inside an async generator
    ends it (the cancellation is raised in its frame); the next pull says so rather than
    ending the pass as if the data had run out.

    It is never closed while a pull of it runs (an async generator refuses that: "aclose():
    asynchronous generator is already running"), as a loader thread never closes its iterator
    during a pull: a close asked meanwhile is made by that pull as it ends, in its own task,
    and the pull then gives ``_END``, its item dropped with the rest of the closed pass.
    """

    __slots__ = ("_close_pending", "_closed", "_iterator", "_lost", "_pulling")

    def __init__(self, iterator: AsyncIterator[Any]) -> None:
        self._iterator = iterator
        self._lost = False
        self._pulling = False
        self._closed = False  # asked to close: pulls give ``_END``
        self._close_pending = False  # asked during a pull, which makes the close

    async def pull(self) -> Any:
        """The iterator's next item, or ``_END``: at its end, and once the source is closed
        (by a close asked while this pull ran, too).

        Raises:
            RuntimeError: an earlier given-up pull ended the async generator.
            BaseException: whatever the iterator raised, unchanged.
        """
        if self._closed:
            return _END
        if self._lost:
            raise RuntimeError(_GENERATOR_CANCELLED.format(name=_name_of(self._iterator)))
        self._pulling = True
        try:
            item = await anext(self._iterator, _END)
        except anyio.get_cancelled_exc_class():
            iterator = self._iterator
            self._lost = inspect.isasyncgen(iterator) and iterator.ag_frame is None
            raise
        finally:
            self._pulling = False
            if self._close_pending:
                self._close_pending = False
                with anyio.CancelScope(shield=True):  # the finally of a cancelled pull too
                    await self._close_iterator()
        return _END if self._closed else item

    async def close(self) -> None:
        """Close the iterator (an async generator's ``finally`` runs now), or, while a pull
        of it runs, have that pull close it as it ends. Later pulls give ``_END``."""
        if self._closed:
            return
        self._closed = True
        # Interleaved pipelines close their own sources the same way, each after its pull:
        # closed now, a round being pulled ends at once.
        if self._pulling and not isinstance(self._iterator, _InterleavedAsync):
            self._close_pending = True
            return
        await self._close_iterator()

    async def _close_iterator(self) -> None:
        close_async = getattr(self._iterator, "aclose", None)
        if close_async is not None:
            await close_async()


def _name_of(iterator: Any) -> str:
    return getattr(iterator, "__qualname__", type(iterator).__name__)


_GENERATOR_CANCELLED: Final = (
    "the dataset's async generator {name}() ended when a wait for its next element was given "
    "up (a timeout or a cancelled task): the cancellation was raised inside the generator, "
    "which ends it, and its remaining elements are gone. Start a new pass over a new "
    "generator, or keep waits on this one from being cancelled (shield them), or make the "
    "dataset a synchronous generator (pulled on a loader thread, where a given-up wait loses "
    "nothing) or an async iterator whose __anext__ survives a cancellation"
)


@final
@dataclass(frozen=True, slots=True)
class ValueContext:
    """Which replica a value function is making a value for (``experimental_distribute_
    values_from_function``).

    Attributes:
        replica_id_in_sync_group: the replica, from 0.
        num_replicas_in_sync: replicas in all.

    Raises:
        TypeError: a field is not an int.
        ValueError: ``num_replicas_in_sync`` is below 1, or ``replica_id_in_sync_group`` is
            not below it.

    Example:
        >>> ValueContext(1, 2).replica_id_in_sync_group
        1
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        replicas = checked_integer(
            self.num_replicas_in_sync, "ValueContext: num_replicas_in_sync must be an int >= 1", 1
        )
        replica = checked_integer(
            self.replica_id_in_sync_group,
            f"ValueContext: replica_id_in_sync_group must be an int from 0 to {replicas - 1} "
            f"(one of its {replicas} replicas)",
            0,
            replicas - 1,
        )
        object.__setattr__(self, "replica_id_in_sync_group", replica)
        object.__setattr__(self, "num_replicas_in_sync", replicas)


@final
class OptionalValue(Generic[T]):
    """An element that may be missing: what ``get_next_as_optional`` returns, as in TF.

    Example:
        >>> OptionalValue(3).get_value()
        3
    """

    __slots__ = ("_value",)

    def __init__(self, value: Any = _END) -> None:
        self._value = value

    def has_value(self) -> bool:
        """Whether there is a value.

        Example:
            >>> OptionalValue().has_value()
            False
        """
        return self._value is not _END

    def get_value(self) -> T:
        """The value.

        Raises:
            ValueError: there is none (the iteration had ended).

        Example:
            >>> OptionalValue("batch").get_value()
            'batch'
        """
        if self._value is _END:
            raise ValueError("this OptionalValue is empty: the iteration had ended")
        value: T = self._value
        return value

    def __repr__(self) -> str:
        return f"OptionalValue({'' if self._value is _END else repr(self._value)})"


# -- the distributed dataset -------------------------------------------------------------


@final
class DistributedDataset:
    """An async iterable of per-replica batches (``strategy.distribute_dataset``).

    Each ``aiter()`` is a new pass over the underlying dataset. See the module docstring.

    Example:
        >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> dataset = strategy.distribute_dataset(aioreplica.batched(np.arange(6), 4))
        >>> def step(x):
        ...     return int(x.sum())
        >>> async def epoch():
        ...     return [await strategy.run(step, args=(batch,)) async for batch in dataset]
        >>> anyio.run(epoch)
        [PerReplica({0: 1, 1: 5}), PerReplica({0: 4, 1: 5})]
        >>> anyio.run(epoch)  # each pass starts over
        [PerReplica({0: 1, 1: 5}), PerReplica({0: 4, 1: 5})]
    """

    def __init__(
        self,
        dataset: Any,
        devices: Sequence[Device],
        *,
        per_replica_source: bool,
        drop_remainder: bool,
        prefetch: SupportsIndex,
        input_context: InputContext,
        workers: Workers | None = None,
        first_replica: int = 0,
        place: bool = True,
    ) -> None:
        count = checked_prefetch(prefetch)
        check_iterable(dataset)
        self._dataset = dataset
        self._devices = tuple(devices)
        self._per_replica_source = per_replica_source
        self._drop_remainder = drop_remainder
        self._prefetch = count
        self._input_context = input_context
        self._workers = workers
        self._first_replica = first_replica
        self._place = place
        # A one-shot iterator (a generator) is the same object on every pass, so every pass
        # shares its loader thread: a new pass must wait for a pull an earlier one gave up on.
        one_shot = isinstance(dataset, Iterator) and _pulled_on_a_thread(dataset)
        self._loader = _LoaderThread(dataset) if one_shot else None

    def __aiter__(self) -> DistributedIterator:
        puller = _Puller(
            self._dataset,
            self._devices,
            per_replica_source=self._per_replica_source,
            drop_remainder=self._drop_remainder,
            input_context=self._input_context,
            loader=self._loader,
            # A pass's agreements get their own communicator: the prefetch task's never
            # interleave with the step's collectives.
            workers=(
                self._workers.duplicate("a dataset pass") if self._workers is not None else None
            ),
            first_replica=self._first_replica,
            place=self._place,
        )
        return DistributedIterator(puller, self._prefetch, self._workers)

    async def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
        """Run ``reduce_func`` over all the elements of one pass, as TF's ``reduce``.

        ``state = reduce_func(state, element)`` for each element, in order, starting from
        ``initial_state``, an element being what ``async for`` gives (per-replica values); the
        pass is closed when it ends, by its end or by an exception.

        Returns:
            The state after the last element (``initial_state`` for an empty dataset).

        Raises:
            TypeError: ``reduce_func`` is not callable, or returned a coroutine (which is closed).
            Exception: whatever the dataset or ``reduce_func`` raised, unchanged.

        Example:
            >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> dataset = strategy.distribute_dataset(aioreplica.batched(np.arange(6), 4))
            >>> def count_rows(rows, element):
            ...     return rows + sum(len(part) for part in element.values)
            >>> anyio.run(dataset.reduce, 0, count_rows)
            6
        """
        if not callable(reduce_func):
            raise TypeError(
                f"reduce_func must be callable (state, element) -> state, got "
                f"{type(reduce_func).__name__} {reduce_func!r:.60}"
            )
        state = initial_state
        async with aiter(self) as iterator:
            async for element in iterator:
                state = reduce_func(state, element)
                if inspect.iscoroutine(state):
                    state.close()
                    raise TypeError(
                        "DistributedDataset.reduce: reduce_func returned a coroutine; it must "
                        "return the new state, so make it a plain function, not a coroutine "
                        "function"
                    )
        return state

    def __iter__(self) -> NoReturn:
        """Refused: a distributed dataset is iterated with ``async for``, in a coroutine.

        Raises:
            TypeError: always, saying so.

        Example:
            >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> for batch in strategy.distribute_dataset([np.arange(2)]):  # doctest: +ELLIPSIS
            ...     pass
            Traceback (most recent call last):
            ...
            TypeError: a DistributedDataset is an async iterable: iterate it with `async for ...
        """
        _refuse_sync_iteration(self)


@final
class DistributedIterator:
    """One pass over a ``DistributedDataset``: ``async for``, ``get_next``, ``aclose``.

    Use ``async with aiter(dataset) as iterator:`` (or ``aclose()``) when it may be left
    before its end while still referenced; an iterator that is simply dropped (a ``break`` out
    of ``async for``) stops its prefetching as well. That closes the dataset: with
    ``prefetch > 0`` a new pass over the same one-shot iterator (a generator) is empty, while
    with ``prefetch=0`` (nothing closed) it continues from the element after the last one
    handed out.

    A wait for the next element can be given up at any time (a timeout, a cancelled task), even
    while a synchronous loader blocks: it returns at once and the pull runs on. With
    ``prefetch=0`` nothing is lost: the next wait takes the element of that pull, and waits for
    it if it is still running (never starting a second pull beside it, which would re-enter the
    loader). That holds for synchronous datasets and for async iterators that survive a
    cancellation, but not for an async generator: the cancellation is raised inside it, which
    ends it, so the next wait raises ``RuntimeError`` saying so (never a silent end). With
    ``prefetch > 0`` a given-up wait ends the prefetching and closes the dataset, as leaving
    the iteration does; a later wait on this iterator raises ``RuntimeError``.

    An iterator over a ``batched`` dataset can be saved in a ``Checkpoint``, with the elements
    it has handed out (not those prefetched) as its position. Restore it into a fresh iterator
    over the same dataset, before its first element; the number of replicas may differ.

    Example:
        >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> dataset = strategy.distribute_dataset(aioreplica.batched(np.arange(3), 4))
        >>> async def first():
        ...     async with aiter(dataset) as iterator:
        ...         return await iterator.get_next()
        >>> anyio.run(first)
        PerReplica({0: array([0, 1]), 1: array([2])})
    """

    def __init__(self, puller: _Puller, prefetch: int, workers: Workers | None = None) -> None:
        # The prefetch task holds the puller, never the iterator: so a dropped iterator is
        # freed at once, and its ``__del__`` stops the task.
        self._puller = puller
        self._prefetch = prefetch
        #: The strategy's workers (not the pass's own stream): a checkpoint of this iterator
        #: is collective over them.
        self._workers = workers
        self._closed = False
        self._background: _loops.Background | None = None
        self._receive: MemoryObjectReceiveStream[Any] | None = None
        self._consumed = 0  # batches of a ``batched`` source handed out, for a checkpoint
        #: With ``prefetch=0``: the pull of the task asking, one at a time (made on first use),
        #: and the event loop it was made on (``_pull_lock``).
        self._pulling: anyio.Lock | None = None
        self._pulling_loop: weakref.ref[object] | None = None

    # -- the iterator protocol --------------------------------------------------------------

    @staticmethod
    async def _receive_element(receive: MemoryObjectReceiveStream[Any]) -> Any:
        """The next prefetched element: at once if one is ready (a cancelled caller still
        sees its cancellation), else once the prefetch task sends it."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        try:
            return receive.receive_nowait()
        except anyio.WouldBlock:
            return await receive.receive()

    def __aiter__(self) -> DistributedIterator:
        return self

    async def __anext__(self) -> Any:
        if self._closed:
            raise StopAsyncIteration
        if self._prefetch == 0:
            async with self._pull_lock():  # several tasks asking take their elements in turn
                return await self._pull_now()
        if self._receive is None:
            send, self._receive = anyio.create_memory_object_stream[Any](self._prefetch)
            puller = self._puller
            context = contextvars.copy_context()  # the dataset's code sees the caller's
            self._background = _loops.current().spawn_background(
                lambda: _prefetch(puller, send, context)
            )
        try:
            element = await self._receive_element(self._receive)
        except anyio.EndOfStream:
            self._receive.close()
        except anyio.ClosedResourceError:
            if self._closed:  # aclose() ran while this wait was in progress
                raise StopAsyncIteration from None
            # An earlier wait was given up, or the event loop of the prefetching ended: every
            # later wait says so, never an end of the data that was not reached.
            stopped = _PREFETCH_LOOP_ENDED if self._puller.loop_ended else _PREFETCH_STOPPED
            raise RuntimeError(stopped) from None
        except BaseException:
            self._stop_prefetching()  # cancelled while waiting: the iteration is over
            raise
        else:
            self._hand_on()
            return element
        if self._puller.loop_ended:  # the stream stays closed: the next wait raises again
            raise RuntimeError(_PREFETCH_LOOP_ENDED)
        self._closed = True
        error, self._puller.error = self._puller.error, None
        if error is not None:
            raise error  # the dataset's own exception, untouched (raised outside any except)
        raise StopAsyncIteration

    def _pull_lock(self) -> anyio.Lock:
        """The lock of ``prefetch=0``'s pulls, made for the running event loop: again when the
        iterator goes on in another loop (an anyio lock works on the kind of loop that made
        it), once no wait of the loop before holds it.

        Raises:
            RuntimeError: a wait on this iterator in another event loop still holds it.
        """
        loop = anyio.lowlevel.current_token().native_token  # an asyncio loop, a trio run's token
        made_on = None if self._pulling_loop is None else self._pulling_loop()
        if self._pulling is None or made_on is not loop:
            if self._pulling is not None and self._pulling.locked():
                raise RuntimeError(_PULLING_ELSEWHERE)
            self._pulling = anyio.Lock()
            self._pulling_loop = weakref.ref(loop)
        return self._pulling

    async def _pull_now(self) -> Any:
        """``__anext__`` with ``prefetch=0``: the next element, pulled by the task asking."""
        if self._closed:  # another task's pull met the end meanwhile
            raise StopAsyncIteration
        pulling = self._puller.next_element()
        recorder = _trace.recorder
        if recorder is not None:  # made on demand: on the track of the task asking
            pulling = recorder.timed(pulling, "dataset prefetch", {"ahead": 0})
        element = await pulling
        if element is _END:
            self._closed = True
            await self._puller.finish()
            raise StopAsyncIteration
        self._hand_on()
        return element

    async def get_next(self) -> Any:
        """The next element.

        Raises:
            StopAsyncIteration: the dataset is exhausted.
            RuntimeError: an earlier wait on this iterator was given up with ``prefetch > 0``,
                or ended the dataset's async generator, or the prefetching stopped with the
                event loop it ran on.
            Exception: whatever the dataset raised, unchanged.

        Example:
            >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> dataset = strategy.distribute_dataset(aioreplica.batched(np.arange(3), 4))
            >>> async def first_two():
            ...     async with aiter(dataset) as iterator:
            ...         first = await iterator.get_next()
            ...         try:
            ...             await iterator.get_next()
            ...         except StopAsyncIteration:
            ...             return first, "then StopAsyncIteration"
            >>> anyio.run(first_two)
            (PerReplica({0: array([0, 1]), 1: array([2])}), 'then StopAsyncIteration')
        """
        return await self.__anext__()

    async def get_next_as_optional(self) -> OptionalValue[Any]:
        """The next element as an ``OptionalValue``: empty at the end instead of raising.

        Raises:
            RuntimeError: an earlier wait on this iterator was given up with ``prefetch > 0``,
                or ended the dataset's async generator, or the prefetching stopped with the
                event loop it ran on.
            Exception: whatever the dataset raised, unchanged.

        Example:
            >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> dataset = strategy.distribute_dataset(aioreplica.batched(np.arange(3), 4))
            >>> async def first_two():
            ...     async with aiter(dataset) as iterator:
            ...         return [await iterator.get_next_as_optional() for _ in range(2)]
            >>> anyio.run(first_two)
            [OptionalValue(PerReplica({0: array([0, 1]), 1: array([2])})), OptionalValue()]
        """
        try:
            return OptionalValue(await self.__anext__())
        except StopAsyncIteration:
            return OptionalValue()

    async def aclose(self) -> None:
        """Stop prefetching, wait for it to end, and close the underlying dataset.

        A synchronous dataset is closed on its loader thread (a generator's ``finally`` runs
        there) and waited for; but while a pull of it is still running (a loader that blocks),
        ``aclose`` returns at once and the close follows that pull, if it ever ends. So it is
        for an async dataset whose pull another task waits for: that task closes it (an async
        generator's ``finally`` runs there) once the pull ends. A task waiting for the next
        element meanwhile gets the end of the iteration (``StopAsyncIteration``), never the
        element being made, nor part of one.

        Example:
            >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> dataset = strategy.distribute_dataset(aioreplica.batched(np.arange(12), 4))
            >>> async def peek():
            ...     iterator = aiter(dataset)
            ...     first = await iterator.get_next()
            ...     await iterator.aclose()
            ...     return first, await iterator.get_next_as_optional()  # closed: no more
            >>> anyio.run(peek)
            (PerReplica({0: array([0, 1]), 1: array([2, 3])}), OptionalValue())
        """
        self._closed = True
        background = self._background
        self._stop_prefetching()
        if background is not None:
            with anyio.CancelScope(shield=True):
                await background.wait()
        else:
            await self._puller.finish()

    async def __aenter__(self) -> DistributedIterator:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __iter__(self) -> NoReturn:
        """Refused: the iterator is used with ``async for`` or ``await get_next()``.

        Raises:
            TypeError: always, saying so.

        Example:
            >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> iterator = aiter(strategy.distribute_dataset([np.arange(2)]))
            >>> next(iter(iterator))  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            TypeError: a DistributedIterator is an async iterable: iterate it with `async for ...
        """
        _refuse_sync_iteration(self)

    def __del__(self) -> None:
        # Dropped without aclose (a ``break`` out of ``async for``): stop the prefetcher.
        with contextlib.suppress(RuntimeError):  # the event loop is already closed
            self._stop_prefetching()

    def _stop_prefetching(self) -> None:
        receive = getattr(self, "_receive", None)
        if receive is not None:
            receive.close()
        background = getattr(self, "_background", None)
        if background is not None and not background.done:
            self._puller.stopped = True
            background.cancel()

    def _hand_on(self) -> None:
        """Note the dataset's position after the element being handed out (what a checkpoint
        saves): the one the puller noted when it made that element."""
        positions = self._puller.positions
        if positions:
            self._consumed = positions.popleft()

    # -- checkpoints: the ``ResumableInput`` of ``aioreplica._batched`` ----------------------

    def _input_source(self) -> BatchedIterator | None:
        """The ``batched`` iterator this pass pulls from, or None for another source."""
        return self._puller.source

    def _source_kind(self) -> str:
        """What this pass pulls from, for messages: ``batched``, ``generator``, ``list``..."""
        kind = self._puller.source_kind
        # (``InputReplicationMode.PER_REPLICA``'s interleaving of pipelines is internal)
        return _PER_REPLICA_PIPELINES if kind.startswith("_") else kind

    def _input_workers(self) -> Workers | None:
        """The workers of a multi-worker strategy's pass, over which a checkpoint of it is
        collective (each worker saves and restores its own place); None on one worker."""
        return self._workers

    def _input_state(self) -> dict[str, Any]:
        return self._batched_source()._input_state(self._consumed)

    def _input_differences(self, state: dict[str, Any]) -> list[str]:
        return self._batched_source()._input_differences(state)

    def _input_problem(self, state: dict[str, Any]) -> str | None:
        source = self._batched_source()
        problem = source._input_problem(state)
        if problem is not None:
            return problem
        if self._closed:
            return "this DistributedIterator is closed; restore into a fresh one (aiter(dataset))"
        if self._receive is not None or source.position != self._consumed:
            return (
                "this DistributedIterator has pulled elements ahead of those it handed out, "
                "which a restore would skip; restore into a fresh one (aiter(dataset)) before "
                "its first element, or use prefetch=0"
            )
        return None

    def _restore_input(self, state: dict[str, Any]) -> None:
        self._batched_source()._restore_input(state)
        self._consumed = state["position"]

    def _batched_source(self) -> BatchedIterator:
        source = self._puller.source
        if source is None:  # Checkpoint refuses such an iterator when it is given one
            raise TypeError(f"a DistributedIterator over a {self._source_kind()} has no position")
        return source


#: What a pass over ``InputReplicationMode.PER_REPLICA``'s pipelines pulls from, for messages.
_PER_REPLICA_PIPELINES: Final = (
    "per-replica set of input pipelines (InputReplicationMode.PER_REPLICA)"
)


_PREFETCH_STOPPED: Final = (
    "this DistributedIterator stopped when a wait for its next element was cancelled: with "
    "prefetch > 0 that ends the prefetching and closes the dataset, and the elements already "
    "prefetched are gone. Start a new pass with aiter(dataset), or use prefetch=0, where a "
    "cancelled wait loses nothing and the next wait continues the iteration"
)


_PREFETCH_LOOP_ENDED: Final = (
    "this DistributedIterator's prefetching stopped when the event loop it ran on ended (an "
    "iterator used in one anyio.run() and then another): the elements it had prefetched were "
    "handed out, and the dataset is closed. Start a new pass with aiter(dataset) in this "
    "loop, or use prefetch=0 to continue one iterator across event loops"
)


_PULLING_ELSEWHERE: Final = (
    "this DistributedIterator is still pulling its next element for a task of another event "
    "loop (one running in another thread, or one that ended without cancelling that task): "
    "with prefetch=0 one iterator goes on across event loops one after another, not in two "
    "at once. Let that wait end first, or start a new pass with aiter(dataset) in this loop"
)


def _refuse_sync_iteration(dataset: DistributedDataset | DistributedIterator) -> NoReturn:
    """Raise the TypeError that a plain ``for`` over a distributed dataset gets."""
    kind = type(dataset).__name__
    raise TypeError(
        f"a {kind} is an async iterable: iterate it with `async for element in ...` inside a "
        f"coroutine (or await get_next() on aiter(dataset)); a plain `for` would have to block "
        f"the event loop while the next element is pulled and placed"
    )


async def _prefetch(
    puller: _Puller, send: MemoryObjectSendStream[Any], context: contextvars.Context
) -> None:
    """The prefetch task: pull, split and place elements ahead; hand on the dataset's error.
    It runs in a copy of ``context``, that of the task that started the pass, as the pulls
    of ``prefetch=0`` do (trio starts a system task in a context of its own).

    While a trace is recorded each element made is a span ``dataset prefetch`` on a
    ``prefetch`` track (``ahead``: how many elements it may make ahead).
    """
    for variable, value in context.items():  # this task's context is its own copy
        variable.set(value)
    _trace.detach("prefetch")  # not under the task that started it (a replica, perhaps)
    try:
        while True:
            pulling = puller.next_element()
            recorder = _trace.recorder
            if recorder is not None:
                ahead = send.statistics().max_buffer_size
                pulling = recorder.timed(pulling, "dataset prefetch", {"ahead": ahead})
            element = await pulling
            if element is _END:
                break
            await send.send(element)
    except anyio.get_cancelled_exc_class():
        if not puller.stopped:  # not by the iterator: its event loop is ending
            puller.loop_ended = True
    except anyio.BrokenResourceError:
        pass  # the consumer is gone
    except BaseException as exc:
        puller.error = exc  # set before the stream closes, so the consumer sees it
    finally:
        send.close()
        with anyio.CancelScope(shield=True):
            await puller.finish()


class _Puller:
    """Pulls from the underlying dataset and makes elements: everything the prefetch task
    needs, and nothing that refers back to the iterator."""

    def __init__(
        self,
        dataset: Any,
        devices: tuple[Device, ...],
        *,
        per_replica_source: bool,
        drop_remainder: bool,
        input_context: InputContext,
        loader: _LoaderThread | None,
        workers: Workers | None = None,
        first_replica: int = 0,
        place: bool = True,
    ) -> None:
        self._devices = devices
        #: Each replica's data goes to its device (``InputOptions.experimental_fetch_to_device``;
        #: else it stays as the dataset made it), read-only where it is host memory.
        self._put: list[Callable[[Any], Any]] = [
            _read_only_after(device.asarray if place else _as_is) for device in devices
        ]
        self._workers = workers
        self._first_replica = first_replica
        self._per_replica = per_replica_source
        self._drop_remainder = drop_remainder
        self._input_context = input_context
        self._sync: Iterator[Any] | None = None  # in-memory data, pulled inline
        self._async: _AsyncSource | None = None
        self._loader: _LoaderThread | None = None  # anything else synchronous
        #: Across workers, what starting this pass over the dataset raised: raised by the
        #: first pull instead, in the pass's first agreement, so the others' pass ends too.
        self._failed: Exception | None = None
        try:
            if hasattr(dataset, "__aiter__"):
                self._async = _AsyncSource(aiter(dataset))
            elif not _pulled_on_a_thread(dataset):
                self._sync = iter(dataset)
            else:
                self._loader = loader if loader is not None else _LoaderThread(dataset)
        except Exception as exc:
            if workers is None:
                raise
            self._failed = exc
        #: A ``batched`` epoch, whose position a checkpoint can save; None for other sources.
        self.source = self._sync if isinstance(self._sync, BatchedIterator) else None
        self.source_kind = type(dataset).__name__
        #: The source's position after each element made and not yet handed out, oldest first.
        self.positions: deque[int] | None = None if self.source is None else deque()
        # The size a full batch has, for ``drop_remainder``: known from the start for a
        # ``batched`` source, so that a pass restored just before the last batch drops it too.
        self._first_rows = None if self.source is None else self.source._first_batch_rows()
        self._round: list[Any] = []  # a round of per-replica batches begun by a given-up wait
        #: With ``drop_remainder``: the batch after a smaller one, pulled to see whether that
        #: one was the last (``_END``: none).
        self._ahead: Any = _END
        self._last: Any = None  # the last per-replica batch seen, for its shape
        self._exhausted = False
        #: The global batches split so far, and the last one's fingerprint (``_fingerprint``),
        #: which the workers compare: each takes its slices of its own copy of the batch.
        self._batches = 0
        self._fingerprint = 0
        #: Across workers, whether they agreed that the pass has ended (none has data left,
        #: or one's dataset raised): else a worker that closes or drops it first tells the
        #: others, which may be waiting in its next agreement.
        self._ended = [workers is None]
        if workers is not None:
            workers.tell_left_if_dropped(self, self._ended)
        #: What the dataset raised, for the consumer to raise (with prefetching).
        self.error: BaseException | None = None
        #: Whether the iterator stopped its prefetch task: a cancellation not asked for came
        #: from its event loop ending.
        self.stopped = False
        #: Whether the prefetch task ended with its event loop: every later wait on the
        #: iterator, once the elements prefetched are handed out, raises ``RuntimeError``.
        self.loop_ended = False
        #: Whether the pass is closed (``finish``): a pull still running then gives ``_END``,
        #: and the element it was for is not made (never part of one, for a round).
        self.closed = False

    async def _pull(self) -> Any:
        """The next item of the underlying dataset, or ``_END``; a blocking one on its thread."""
        if self._failed is not None:
            self._exhausted = True
            failed, self._failed = self._failed, None
            raise failed
        if self._exhausted:
            return _END
        try:
            # What an iterator yields is copied as it comes: it may change when it yields again
            # (a loader refilling one buffer) while a step, a batch pulled ahead or a caller
            # still holds it. In-memory data (pulled inline) is never refilled.
            if self._async is not None:
                item = await self._async.pull()
            elif self._loader is not None:  # copied on the loader thread, as part of the pull
                item = await self._loader.pull()
            elif self._sync is not None:
                await anyio.lowlevel.checkpoint()
                if self.closed:
                    item = _END
                elif self.source is not None:
                    item = await _next_batch(self.source)
                else:
                    item = next(self._sync, _END)
            else:  # finished
                return _END
        except Exception:
            if not self.closed:
                raise
            item = _END  # closed while this pull ran: what it raised is not handed out either
        if self.closed:  # closed while this pull ran: its item is not handed out
            item = _END
        if item is _END:
            self._exhausted = True
        elif self._async is not None:
            item = await _owned_off_loop(item)
        return item

    async def next_element(self) -> Any:
        """The next element (replicas' slices, regrouped), or ``_END``; with several workers,
        once they agree that any of them still has data (zero-row slices where this one has
        none), and that none of their datasets raised.

        Raises:
            ReplicaSyncError: another worker's dataset raised (this pass ends on every worker;
                that worker raises its dataset's exception).
            WorkersDisagree: the workers' global batches differ.
        """
        if self._workers is None:
            element = await self._next_local()
            return _END if self.closed else element
        workers = self._workers
        try:
            element = await self._next_local()
        except Exception as exc:  # told in this step's agreement: the others must not wait
            with contextlib.suppress(RuntimeError):  # a peer failed, or the cluster is broken:
                marks = await workers.allgather_rows(
                    np.array([[_RAISED, 0]], np.int64), what=_NEXT_BATCH
                )
                self._ended[0] = True
                await self._end_for_a_failure(marks, exc)  # this worker's error is still the one
            raise
        if self.closed:  # and so is the pass's communicator: no agreement on this element
            return _END
        mark = np.array([[element is not _END, self._fingerprint]], np.int64)
        marks = await workers.allgather_rows(mark, what=_NEXT_BATCH)
        if (marks[:, 0] == _RAISED).any():
            self._ended[0] = True
            await self._end_for_a_failure(marks, None)
        have = marks[:, 0].astype(bool)
        if not have.any():
            self._ended[0] = True
            return _END
        if not self._per_replica:
            self._check_same_batch(marks[have, 1], np.flatnonzero(have))
        if have.all():
            return element
        root = int(np.flatnonzero(have)[0])
        spec = b""
        if workers.worker_index == root:  # what an empty element is, or why there is none
            try:
                ran_out = worker_list([int(w) for w in np.flatnonzero(~have)])
                spec = pickle.dumps(_zero_rows(element, f"on {ran_out} before the others"))
            except TypeError as exc:
                spec = pickle.dumps(exc)
        spec = await workers.broadcast_bytes(spec, root)
        empty = pickle.loads(spec)
        if isinstance(empty, TypeError):
            raise empty  # on every worker alike
        if element is not _END:
            return element
        return self._placed_zero_rows(empty)

    async def _end_for_a_failure(
        self, marks: np.ndarray[Any, Any], error: Exception | None
    ) -> None:
        """The end of this pass when the step's ``marks`` say that a worker's dataset raised
        (``error``, when it was this worker's): the first of those workers tells what its
        dataset raised; the others raise ``ReplicaSyncError`` naming them, and they go on to
        raise their own exceptions.

        Raises:
            ReplicaSyncError: another worker's dataset raised.
        """
        workers = self._workers
        assert workers is not None
        raised = [int(w) for w in np.flatnonzero(marks[:, 0] == _RAISED)]
        said = error_line(error).encode() if error is not None else b""
        said = await workers.broadcast_bytes(said, raised[0])
        if error is None:
            raise ReplicaSyncError(
                f"the dataset of {worker_list(raised)} raised {said.decode(errors='replace')}; "
                f"this pass over the dataset ends on every worker (worker "
                f"{workers.worker_index}'s included)",
                merge_number=None,
                workers=raised,
            )

    def _check_same_batch(self, fingerprints: np.ndarray[Any, Any], holders: Any) -> None:
        """Refuse a global batch that differs between the workers that have one.

        Raises:
            WorkersDisagree: the fingerprints differ (alike on every worker).
        """
        if (fingerprints == fingerprints[0]).all():
            return
        others = [
            int(w) for w, f in zip(holders, fingerprints, strict=True) if f != fingerprints[0]
        ]
        raise WorkersDisagree(
            f"distribute_dataset: global batch {self._batches - 1} (from 0) of this pass is not "
            f"the same on every worker (it differs on {worker_list(others)} from worker "
            f"{int(holders[0])}'s). Every worker must iterate the same global batches (made the "
            "same way, shuffled with the same seed), since each takes its own replicas' slices "
            "of its own copy; for input that differs per worker, use "
            "distribute_datasets_from_function"
        )

    def _placed_zero_rows(self, spec: Any) -> Any:
        """An element of zero-row slices shaped as ``spec`` (one host array per leaf)."""
        leaves, treedef = _tree.flatten(spec)
        if len(self._devices) == 1:
            return treedef.unflatten([self._put[0](leaf) for leaf in leaves])
        return treedef.unflatten([PerReplica([put(leaf) for put in self._put]) for leaf in leaves])

    async def _next_local(self) -> Any:
        """This worker's next element, or ``_END``."""
        if self._per_replica:
            parts = await self._pull_round()
            if parts is None:
                return _END
            placed = [
                _tree.map_structure(put, part) for put, part in zip(self._put, parts, strict=True)
            ]
            self._note_position()
            return regroup(placed, PerReplica)
        split = await self._pull_split()
        if split is None:
            return _END
        self._note_position()
        treedef, columns = split
        if len(self._devices) == 1:
            return treedef.unflatten([column[0] for column in columns])
        return treedef.unflatten([PerReplica(column) for column in columns])

    def _note_position(self) -> None:
        """Note the source's position after the element just made (see ``positions``)."""
        if self.positions is not None:
            assert self.source is not None
            ahead = self._ahead is not _END  # a batch pulled ahead is not handed out yet
            self.positions.append(self.source.position - ahead)

    async def _pull_split(self) -> tuple[_tree.TreeDef, list[list[Any]]] | None:
        """The next global batch cut into slices: per leaf, one placed slice per replica."""
        if self._ahead is not _END:  # pulled to see that a smaller batch was not the last
            batch, self._ahead = self._ahead, _END
        else:
            batch = await self._pull()
        if batch is _END:
            return None
        leaves, treedef = _tree.flatten(batch)
        if self._input_context.num_replicas_in_sync == 1 and _unbatched(leaves):
            # One replica in all takes each element whole, as in TF: a batch dimension is only
            # needed to cut one, so numbers and other unbatched elements pass as they are.
            self._batches += 1
            return treedef, [[self._put[0](leaf)] for leaf in leaves]
        rows = batch_rows(batch, leaves, "distribute_dataset")
        if self._first_rows is None:
            self._first_rows = rows
        elif self._drop_remainder and rows < self._first_rows:
            # Only the last batch is dropped: a smaller one is split if another follows it
            # (pulled ahead only here, so prefetch=0 pulls one batch per element otherwise).
            try:
                following = await self._pull()
            except BaseException:
                self._ahead = batch  # a given-up wait: the next one looks again
                raise
            if following is _END:
                return None
            self._ahead = following
        self._batches += 1
        if self._workers is not None:
            self._fingerprint = _fingerprint(leaves, treedef)
        # This pipeline's contiguous part of the global batch, then one slice per replica.
        context = self._input_context
        if self._workers is not None:  # the global batch in slices for every worker's replicas
            first = self._first_replica
            bounds = _shares(rows, context.num_replicas_in_sync)[first : first + len(self._devices)]
        else:
            start, stop = _share(rows, context.num_input_pipelines, context.input_pipeline_id)
            bounds = [(start + a, start + b) for a, b in _shares(stop - start, len(self._devices))]
        columns = [
            [put(leaf[a:b]) for put, (a, b) in zip(self._put, bounds, strict=True)]
            for leaf in leaves
        ]
        return treedef, columns

    async def _pull_round(self) -> list[Any] | None:
        """One batch per replica; a round that a given-up wait had begun goes on from there."""
        parts, self._round = self._round, []
        try:
            while len(parts) < len(self._devices):
                batch = await self._pull()
                if batch is _END:
                    break
                if batch is not _NO_BATCH:  # a PER_REPLICA dataset that ended: filled below
                    leaves = _tree.flatten(batch)[0]
                    if not _unbatched(leaves):  # elements without a batch dimension pass as is
                        batch_rows(batch, leaves, "distribute_datasets_from_function")
                    self._last = batch
                parts.append(batch)
        except BaseException:
            self._round = parts  # the batches pulled so far are the next wait's
            raise
        if not parts or self.closed:  # a closed pass's round is not filled with empty batches
            return None
        self._check_round(parts)
        if len(parts) < len(self._devices):  # ran out mid-round: empty batches
            parts.extend([_NO_BATCH] * (len(self._devices) - len(parts)))
        missing = [part is _NO_BATCH for part in parts]  # ``is``: ``in`` would compare arrays
        if any(missing):
            had = len(self._devices) - sum(missing)
            empty = _zero_rows(self._last, f"after {had} of this round's elements")
            parts = [empty if part is _NO_BATCH else part for part in parts]
        return parts

    def _check_round(self, parts: list[Any]) -> None:
        """Refuse a round whose elements differ in structure: they are regrouped into one
        element of per-replica values.

        Raises:
            ValueError: an element differs from the round's first (any difference: container
                types, keys, lengths, a leaf where the other has a container).
        """
        given = [(j, part) for j, part in enumerate(parts) if part is not _NO_BATCH]
        first, reference = given[0]
        expected = _tree.flatten(reference)[1]
        for j, part in given[1:]:
            if _tree.flatten(part)[1] == expected:
                continue
            name = f"replica {self._first_replica + first}'s element"
            other = f"replica {self._first_replica + j}'s"
            found = _tree.find_mismatch(reference, part, first=name, second=other)
            said = f"{name} and {other} differ"
            if found is not None:
                said = f"at {_tree.describe_path(found[1])}, {found[2]}"
            raise ValueError(
                f"distribute_datasets_from_function: the dataset elements of one step (one per "
                f"replica) differ in structure: {said}; every element of every input pipeline "
                "must have the same structure "
                "(the same containers, keys and lengths), since one step's elements are "
                "regrouped into one element of per-replica values"
            )

    async def finish(self) -> None:
        """Close the underlying iterator (a generator's ``finally`` runs now, not at GC), or,
        while a pull of it still runs, have it closed after that pull, which then gives the
        end of the pass; free a pass's communicator."""
        self.closed = True
        if self._workers is not None:
            if not self._ended[0]:  # left early here: a peer may wait in it for this worker
                self._workers.tell_left()
            self._workers.close()
        if self._async is not None:
            source, self._async = self._async, None
            await source.close()
        elif self._loader is not None:
            await self._loader.close()
        elif self._sync is not None:
            sync, self._sync = self._sync, None
            _close(sync)


# -- the loader thread --------------------------------------------------------------------


def _pulled_on_a_thread(dataset: Any) -> bool:
    """Whether ``dataset`` is pulled on a loader thread: a synchronous one that may block.
    In-memory data (lists, tuples, ``batched``) never blocks and is pulled inline."""
    return not hasattr(dataset, "__aiter__") and not isinstance(dataset, batched | list | tuple)


@final
class _LoaderThread:
    """A synchronous iterable that may block, pulled on a daemon thread of its own.

    The thread makes every call on it (``iter``, each ``next`` and the final ``close``), one at
    a time and in the order asked, so no pull ever starts while another runs: a generator would
    raise "generator already executing", another iterator could be corrupted. A task waiting
    for a pull may give up at once (``_Call.wait``); the pull runs on, and its item goes to the
    next pull asked for, so nothing is lost. The thread is a daemon thread (anyio's worker
    threads are not, and one blocked in a loader would keep the process from exiting); it ends
    after the close, or once this object is collected, when its call in progress returns.
    """

    __slots__ = (
        "__weakref__",
        "_calls",
        "_count",
        "_given_up",
        "_iterator",
        "_last",
        "_name",
        "closed",
    )

    def __init__(self, iterable: Iterable[Any]) -> None:
        # Touched here only before the thread starts; ``iter()`` is the thread's first call.
        self._iterator = iterable if isinstance(iterable, Iterator) else _Iteration(iterable)
        self._name = type(iterable).__name__
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._count = 0  # calls asked so far: the thread starts with the first
        self._last: _Call | None = None  # the call asked last: once it is done, all are
        self._given_up: list[_Call] = []  # pulls whose waiter gave up, oldest first
        self.closed = False

    async def pull(self) -> Any:
        """The iterator's next item, or ``_END``: the oldest pull a waiter gave up, else a
        new one, which copies the item's host arrays on the thread as well.

        Raises:
            BaseException: whatever the iterator raised, unchanged.
        """
        if self.closed:
            return _END
        call = self._given_up.pop(0) if self._given_up else self._ask(_next_owned_item)
        try:
            await call.wait()
        except BaseException:
            bisect.insort(self._given_up, call, key=_order)  # for the next pull, in order
            raise
        return call.outcome()

    async def close(self) -> None:
        """Close the iterator on its thread and wait for that, unless a pull still runs: then
        return at once, the close to follow that pull (a loader that never returns must not
        hold its caller). Later pulls give ``_END``.

        Raises:
            BaseException: whatever the iterator's ``close`` raised, unchanged.
        """
        if self.closed:
            return
        self.closed = True
        self._given_up.clear()
        if self._last is None:  # never pulled: no thread, nothing running
            _close(self._iterator)
            return
        idle = self._last.done
        closing = self._ask(_close)
        self._calls.put(None)  # the thread ends after the close
        if idle:
            await closing.wait()
            closing.outcome()

    def _ask(self, fn: Callable[[Iterator[Any]], Any]) -> _Call:
        """Queue ``fn(iterator)`` for the thread, starting the thread on the first call."""
        if self._last is None:
            thread = threading.Thread(
                target=_serve,
                args=(self._iterator, self._calls),
                name=f"aioreplica loader {self._name}",
                daemon=True,
            )
            thread.start()
            weakref.finalize(self, self._calls.put, None)  # collected: let the thread end
        call = _Call(fn, self._count)
        self._count += 1
        self._calls.put(call)
        self._last = call
        return call


@final
class _Iteration:
    """An iteration over ``iterable`` that calls ``iter()`` on its first pull: on the loader
    thread, where a slow start (a data loader starting its worker processes, a reader opening
    its files) blocks no event loop, and a wait for it can be given up."""

    __slots__ = ("_iterable", "_iterator")

    def __init__(self, iterable: Iterable[Any]) -> None:
        self._iterable: Iterable[Any] | None = iterable
        self._iterator: Iterator[Any] | None = None

    def __iter__(self) -> _Iteration:
        return self

    def __next__(self) -> Any:
        if self._iterable is not None:
            iterable, self._iterable = self._iterable, None
            self._iterator = iter(())  # a start that raised ends the iteration there
            self._iterator = iter(iterable)
        assert self._iterator is not None
        return next(self._iterator)

    def close(self) -> None:
        """Close the iterator, if the iteration has started (a generator's ``finally`` runs)."""
        if self._iterator is not None:
            _close(self._iterator)


def _serve(iterator: Iterator[Any], calls: queue.SimpleQueue[_Call | None]) -> None:
    """The loader thread: make each call asked for, in order, until told to stop. It holds
    the iterator, never its ``_LoaderThread``, so that one can be collected."""
    while (call := calls.get()) is not None:
        call.run(iterator)
        del call  # hold no item between calls


@final
class _Call:
    """One call on the loader thread and its outcome, kept until a waiter takes it.

    A waiter that gives up loses nothing: the outcome stays here for the next waiter. The lock
    orders the thread's "done" against a waiter registering, so no wake-up is missed.
    """

    __slots__ = ("_context", "_error", "_fn", "_lock", "_value", "_waiter", "done", "order")

    def __init__(self, fn: Callable[[Iterator[Any]], Any], order: int) -> None:
        self._fn = fn
        self._context = contextvars.copy_context()  # the asker's, as anyio.to_thread does
        self._lock = threading.Lock()
        self._waiter: _loops.ThreadResult | None = None
        self._value: Any = None
        self._error: BaseException | None = None
        self.done = False
        self.order = order

    def run(self, iterator: Iterator[Any]) -> None:
        """Make the call (on the loader thread) and wake its waiter, if there is one now."""
        try:
            value, error = self._context.run(self._fn, iterator), None
        except BaseException as exc:  # the iterator's own error, for the waiter to raise
            value, error = None, exc
        with self._lock:
            self._value, self._error, self.done = value, error, True
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.set(None, None)

    async def wait(self) -> None:
        """Wait until the call is done; a cancellation ends the wait at once, on every loop."""
        with self._lock:
            waiter = None if self.done else _loops.current().thread_result()
            self._waiter = waiter
        if waiter is None:
            await anyio.lowlevel.checkpoint()
            return
        try:
            await waiter
        finally:
            with self._lock:
                if self._waiter is waiter:
                    self._waiter = None

    def outcome(self) -> Any:
        """The call's value, or its exception raised (once: the reference is dropped)."""
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._value


def _order(call: _Call) -> int:
    return call.order


def _next_owned_item(iterator: Iterator[Any]) -> Any:
    item = next(iterator, _END)
    return item if item is _END else _tree.map_structure(_owned, item)


def _close(iterator: Iterator[Any]) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


# -- helpers -------------------------------------------------------------------------------


def _fingerprint(leaves: list[Any], treedef: _tree.TreeDef) -> int:
    """A CRC-32 of a global batch's structure, shapes and dtypes, and of a sample of its
    values: the first elements of up to ``_SAMPLED_ROWS`` evenly spaced rows of each host
    leaf whose bytes are its values (not Python objects, not records, whose padding may hold
    anything). Cheap at any batch size, and unlike between batches made otherwise (another
    shuffle, other data) on different workers."""
    crc = zlib.crc32(repr(treedef).encode())
    for leaf in leaves:
        crc = zlib.crc32(f"{leaf.shape} {leaf.dtype}".encode(), crc)
        if isinstance(leaf, np.ndarray) and leaf.size and leaf.dtype.kind in _SAMPLED_KINDS:
            rows = np.linspace(0, len(leaf) - 1, min(len(leaf), _SAMPLED_ROWS)).astype(np.intp)
            sample = leaf[rows].reshape(len(rows), -1)[:, :_SAMPLED_VALUES]
            crc = zlib.crc32(np.ascontiguousarray(_by_value(sample)).tobytes(), crc)
    return crc


def _by_value(sample: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``sample``, or for long doubles the bytes that hold its values. An x87 long double
    fills 10 of its 12 or 16 bytes, and the rest hold whatever was in memory, which differs
    between processes: each value (each part of a complex one) is taken as its first
    ``_LONG_DOUBLE_VALUE_BYTES`` bytes, in native byte order. Those are all of it, so values
    beyond or below float64's range are told apart too, and (as for every other dtype) -0.0
    from 0.0 and NaNs by their payloads."""
    if (
        sample.dtype.type not in (np.longdouble, np.clongdouble)
        or np.dtype(np.longdouble).itemsize == _LONG_DOUBLE_VALUE_BYTES  # no padding
    ):
        return sample
    native = np.ascontiguousarray(sample, sample.dtype.newbyteorder("="))
    parts = native.view(np.longdouble)  # a complex value's real and imaginary parts in turn
    return parts.view(np.uint8).reshape(*parts.shape, -1)[..., :_LONG_DOUBLE_VALUE_BYTES]


def _as_is(value: Any) -> Any:
    """Where data is not fetched to the replicas' devices: the value the dataset made."""
    return value


def _read_only_after(put: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``put``, handing a replica host memory as a read-only view: a step's in-place edit of
    its input must not reach the dataset's arrays (TF's tensors are immutable)."""

    def handed(value: Any) -> Any:
        placed = put(value)
        if isinstance(placed, np.ndarray) and placed.flags.writeable:
            placed = placed.view()
            placed.flags.writeable = False
        return placed

    return handed


def _owned(value: Any) -> Any:
    """A host array an iterator yielded, copied (see ``_Puller._pull``)."""
    return value.copy() if isinstance(value, np.ndarray) else value


async def _owned_off_loop(item: Any) -> Any:
    """``item`` with its host arrays copied (``_owned``), on a worker thread when they are
    big (``_COPIED_INLINE_BYTES``), so that the event loop never waits for the copy. The copy
    is never given up midway: a cancellation takes effect at the caller's next checkpoint,
    as it did when copies were made inline, so no item is lost and none is kept uncopied."""
    leaves, treedef = _tree.flatten(item)
    size = sum(leaf.nbytes for leaf in leaves if isinstance(leaf, np.ndarray))
    if size < _COPIED_INLINE_BYTES:
        return treedef.unflatten([_owned(leaf) for leaf in leaves])
    with anyio.CancelScope(shield=True):
        copies = await anyio.to_thread.run_sync(lambda: [_owned(leaf) for leaf in leaves])
    return treedef.unflatten(copies)


async def _next_batch(source: BatchedIterator) -> Any:
    """The next batch of a ``batched`` epoch, or ``_END``. A shuffled batch is gathered from
    the dataset's rows, a copy: on a worker thread when it is big (``_COPIED_INLINE_BYTES``),
    so that the event loop never waits for it. The epoch takes the batch's place before the
    copy, and the copy is never given up midway (as in ``_owned_off_loop``): batches come in
    order, and the position a checkpoint saves is the one they were made at."""
    rows = source._next_rows()
    if rows is None:
        return _END
    if source._gathered_bytes(rows) < _COPIED_INLINE_BYTES or not source._host_only():
        # (a device's arrays are gathered on the device, by a kernel the loop only queues)
        return source._batch(rows)
    with anyio.CancelScope(shield=True):
        return await anyio.to_thread.run_sync(source._batch, rows)


def _empty_rows(leaf: Any) -> Any:
    return leaf[0:0]


def _unbatched(leaves: list[Any]) -> bool:
    """Whether an element has a leaf without a batch dimension (a number, a 0-d array)."""
    return any(not getattr(leaf, "shape", ()) for leaf in leaves)


def _zero_rows(element: Any, where: str) -> Any:
    """``element``'s structure with each leaf a zero-row host array of its dtype and shape.

    Raises:
        TypeError: a leaf has no batch dimension to have zero rows of (``where``: which
            element ran out, for the message).
    """
    leaves, treedef = _tree.flatten(element)
    zeros = []
    for leaf in leaves:
        first = leaf.values[0] if isinstance(leaf, PerReplica) else leaf
        array = first if hasattr(first, "shape") else np.asarray(first)
        if not array.ndim:
            raise TypeError(
                f"distribute_datasets_from_function: the dataset ran out {where}, and its "
                f"elements have no batch dimension (one is {_tree.short_repr(first)}), so the "
                "replicas left without data cannot get empty batches; give every replica an "
                "element in every round, or batch the elements"
            )
        # No rows to copy: a GPU array's empty slice comes to the host with no wait for it.
        zeros.append(host_array(_empty_rows(array)))
    return treedef.unflatten(zeros)


def _shares(rows: int, parts: int) -> list[tuple[int, int]]:
    """``rows`` cut into ``parts`` contiguous ranges, sizes differing by at most one, larger
    first (``numpy.array_split``'s rule)."""
    base, extra = divmod(rows, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return list(itertools.pairwise(bounds))


def _share(rows: int, parts: int, part: int) -> tuple[int, int]:
    return _shares(rows, parts)[part]


def checked_prefetch(prefetch: object) -> int:
    """``prefetch`` as the number of elements a dataset pass pulls ahead.

    Raises:
        TypeError: it is not an integer (``True`` is not 1).
        ValueError: it is negative.
    """
    count = as_integer(prefetch)
    if count is None:
        raise TypeError(f"prefetch must be an int >= 0, got {prefetch!r}")
    if count < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    return count


def distribute_values(
    value_fn: Callable[[ValueContext], Any], num_replicas: int, ids: range
) -> PerReplica[Any]:
    """``PerReplica([value_fn(ValueContext(i, num_replicas)) for i in ids])``: the values of
    this worker's replicas, ``ids`` their global ids.

    Raises:
        TypeError: ``value_fn`` returned a coroutine (it is closed).
    """
    values = []
    for i in ids:
        value = value_fn(ValueContext(i, num_replicas))
        if inspect.iscoroutine(value):
            value.close()
            raise TypeError(
                f"experimental_distribute_values_from_function: value_fn returned a coroutine "
                f"for replica {i}; it must return the value, so make it a plain function, not "
                "a coroutine function (await what it needs before the call)"
            )
        values.append(value)
    return PerReplica(values)
