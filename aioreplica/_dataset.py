"""Distributed input: global batches split across replicas, prefetched, never hanging.

``strategy.distribute_dataset(dataset)`` turns an iterable (or async iterable) of global batches
into an async iterable of per-replica batches:

- **split**: each global batch of B rows is cut along axis 0 into one slice per replica, sizes
  differing by at most one, larger slices first, in replica order. Host slices are views; each
  slice is placed with its replica's ``device.asarray`` (an asynchronous copy on its stream for
  a GPU). An element is ``regroup`` of the replicas' slices.
- **uneven ends**: replicas that get no rows of the last batch get zero-length arrays of the
  right trailing shape and dtype, so every replica takes the same number of steps and none waits
  forever; iteration ends when the dataset does.
- **prefetch**: up to ``prefetch`` elements are pulled, split and placed ahead in a background
  task owned by the iterator. It ends when the iteration ends, ``break``s (the iterator is
  dropped) or is cancelled; a synchronous dataset is pulled in a worker thread, so a slow loader
  never blocks the event loop.
- **input pipelines**: each input pipeline takes its own contiguous part of every global batch
  (``InputContext``). With one process there is one pipeline.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar, final

import anyio

from . import _loops, _tree
from ._batched import batch_rows, batched
from ._values import PerReplica, regroup

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator, Sequence
    from types import TracebackType

    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

    from ._backends import Device

__all__ = [
    "DistributedDataset",
    "DistributedIterator",
    "InputContext",
    "OptionalValue",
    "ValueContext",
]

T = TypeVar("T")

_END: Final = object()


# -- contexts ----------------------------------------------------------------------------


@final
@dataclass(frozen=True, slots=True)
class InputContext:
    """What an input function needs to know about where its data goes, as in TF.

    Attributes:
        num_input_pipelines: how many input pipelines (one per worker) feed the replicas.
        input_pipeline_id: this pipeline's number, from 0.
        num_replicas_in_sync: replicas over all pipelines.

    Example:
        >>> InputContext(num_replicas_in_sync=4).get_per_replica_batch_size(64)
        16
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The per-replica batch size for ``global_batch_size``.

        Raises:
            ValueError: ``global_batch_size`` is not divisible by the number of replicas.

        Example:
            >>> InputContext(num_replicas_in_sync=2).get_per_replica_batch_size(8)
            4
        """
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"the global batch size {global_batch_size} is not divisible by the "
                f"{self.num_replicas_in_sync} replicas in sync; choose a multiple of "
                f"{self.num_replicas_in_sync}"
            )
        return global_batch_size // self.num_replicas_in_sync


@final
@dataclass(frozen=True, slots=True)
class ValueContext:
    """Which replica a value function is making a value for (``experimental_distribute_
    values_from_function``).

    Example:
        >>> ValueContext(1, 2).replica_id_in_sync_group
        1
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


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
        prefetch: int,
        input_context: InputContext,
    ) -> None:
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        if not (hasattr(dataset, "__aiter__") or hasattr(dataset, "__iter__")):
            raise TypeError(
                f"a dataset must be an iterable or async iterable of batches, got "
                f"{type(dataset).__name__}"
            )
        self._dataset = dataset
        self._devices = tuple(devices)
        self._per_replica_source = per_replica_source
        self._drop_remainder = drop_remainder
        self._prefetch = prefetch
        self._input_context = input_context

    def __aiter__(self) -> DistributedIterator:
        puller = _Puller(
            self._dataset,
            self._devices,
            per_replica_source=self._per_replica_source,
            drop_remainder=self._drop_remainder,
            input_context=self._input_context,
        )
        return DistributedIterator(puller, self._prefetch)


@final
class DistributedIterator:
    """One pass over a ``DistributedDataset``: ``async for``, ``get_next``, ``aclose``.

    Use ``async with aiter(dataset) as iterator:`` (or ``aclose()``) when it may be left
    before its end while still referenced; an iterator that is simply dropped (a ``break`` out
    of ``async for``) stops its prefetching as well.

    Example:
        >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> dataset = strategy.distribute_dataset(aioreplica.batched(np.arange(3), 4))
        >>> async def first():
        ...     async with aiter(dataset) as iterator:
        ...         return await iterator.get_next()
        >>> anyio.run(first)
        PerReplica({0: array([0, 1]), 1: array([2])})
    """

    def __init__(self, puller: _Puller, prefetch: int) -> None:
        # The prefetch task holds the puller, never the iterator: so a dropped iterator is
        # freed at once, and its ``__del__`` stops the task.
        self._puller = puller
        self._prefetch = prefetch
        self._closed = False
        self._background: _loops.Background | None = None
        self._receive: MemoryObjectReceiveStream[Any] | None = None

    # -- the iterator protocol --------------------------------------------------------------

    def __aiter__(self) -> DistributedIterator:
        return self

    async def __anext__(self) -> Any:
        if self._closed:
            raise StopAsyncIteration
        if self._prefetch == 0:
            element = await self._puller.next_element()
            if element is _END:
                self._closed = True
                await self._puller.finish()
                raise StopAsyncIteration
            return element
        if self._receive is None:
            send, self._receive = anyio.create_memory_object_stream[Any](self._prefetch)
            puller = self._puller
            self._background = _loops.current().spawn_background(lambda: _prefetch(puller, send))
        try:
            return await self._receive.receive()
        except anyio.EndOfStream:
            self._closed = True
            self._receive.close()
        except BaseException:
            self._stop_prefetching()  # cancelled while waiting: the iteration is over
            raise
        error, self._puller.error = self._puller.error, None
        if error is not None:
            raise error  # the dataset's own exception, untouched (raised outside any except)
        raise StopAsyncIteration

    async def get_next(self) -> Any:
        """The next element.

        Raises:
            StopAsyncIteration: the dataset is exhausted.
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
            background.cancel()


async def _prefetch(puller: _Puller, send: MemoryObjectSendStream[Any]) -> None:
    """The prefetch task: pull, split and place elements ahead; hand on the dataset's error."""
    try:
        while True:
            element = await puller.next_element()
            if element is _END:
                break
            await send.send(element)
    except anyio.get_cancelled_exc_class():
        pass  # the iteration is over
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
    ) -> None:
        self._devices = devices
        self._per_replica = per_replica_source
        self._drop_remainder = drop_remainder
        self._input_context = input_context
        self._sync: Iterator[Any] | None = None
        self._async: AsyncIterator[Any] | None = None
        # In-memory data never blocks: pull it inline, not through a worker thread.
        self._inline = isinstance(dataset, batched | list | tuple)
        if hasattr(dataset, "__aiter__"):
            self._async = aiter(dataset)
        else:
            self._sync = iter(dataset)
        self._first_rows: int | None = None
        self._last: Any = None  # the last per-replica batch seen, for its shape
        self._exhausted = False
        #: What the dataset raised, for the consumer to raise (with prefetching).
        self.error: BaseException | None = None

    async def _pull(self) -> Any:
        """The next item of the underlying dataset, or ``_END``; a sync one in a thread."""
        if self._exhausted:
            return _END
        if self._async is not None:
            try:
                return await anext(self._async)
            except StopAsyncIteration:
                self._exhausted = True
                return _END
        if self._sync is None:  # finished
            return _END
        if self._inline:
            await anyio.lowlevel.checkpoint()
            item = next(self._sync, _END)
        else:
            item = await anyio.to_thread.run_sync(next, self._sync, _END)
        if item is _END:
            self._exhausted = True
        return item

    async def next_element(self) -> Any:
        """The next element (replicas' slices, regrouped), or ``_END``."""
        if self._per_replica:
            parts = await self._pull_round()
            if parts is None:
                return _END
            placed = [
                _tree.map_structure(device.asarray, part)
                for device, part in zip(self._devices, parts, strict=True)
            ]
            return regroup(placed, PerReplica)
        split = await self._pull_split()
        if split is None:
            return _END
        treedef, columns = split
        if len(self._devices) == 1:
            return treedef.unflatten([column[0] for column in columns])
        return treedef.unflatten([PerReplica(column) for column in columns])

    async def _pull_split(self) -> tuple[_tree.TreeDef, list[list[Any]]] | None:
        """The next global batch cut into slices: per leaf, one placed slice per replica."""
        batch = await self._pull()
        if batch is _END:
            return None
        leaves, treedef = _tree.flatten(batch)
        rows = batch_rows(leaves, treedef, "distribute_dataset")
        if self._first_rows is None:
            self._first_rows = rows
        elif self._drop_remainder and rows < self._first_rows:
            self._exhausted = True
            return None
        # This pipeline's contiguous part of the global batch, then one slice per replica.
        context = self._input_context
        start, stop = _share(rows, context.num_input_pipelines, context.input_pipeline_id)
        bounds = [(start + a, start + b) for a, b in _shares(stop - start, len(self._devices))]
        columns = [
            [
                device.asarray(leaf[a:b])
                for device, (a, b) in zip(self._devices, bounds, strict=True)
            ]
            for leaf in leaves
        ]
        return treedef, columns

    async def _pull_round(self) -> list[Any] | None:
        parts: list[Any] = []
        for _ in self._devices:
            batch = await self._pull()
            if batch is _END:
                break
            leaves, treedef = _tree.flatten(batch)
            batch_rows(leaves, treedef, "distribute_datasets_from_function")
            self._last = batch
            parts.append(batch)
        if not parts:
            return None
        while len(parts) < len(self._devices):  # ran out mid-round: empty batches
            parts.append(_tree.map_structure(_empty_rows, self._last))
        return parts

    async def finish(self) -> None:
        """Close the underlying iterator (a generator's ``finally`` runs now, not at GC)."""
        if self._async is not None:
            close_async = getattr(self._async, "aclose", None)
            self._async = None
            if close_async is not None:
                await close_async()
        elif self._sync is not None:
            close = getattr(self._sync, "close", None)
            self._sync = None
            if close is not None:
                close()


def _empty_rows(leaf: Any) -> Any:
    return leaf[0:0]


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


def distribute_values(
    value_fn: Callable[[ValueContext], Any], num_replicas: int
) -> PerReplica[Any]:
    """``PerReplica([value_fn(ValueContext(i, n)) for i in range(n)])``."""
    return PerReplica([value_fn(ValueContext(i, num_replicas)) for i in range(num_replicas)])
