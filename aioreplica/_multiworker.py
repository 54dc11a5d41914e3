"""``MultiWorkerMirroredStrategy``: one step function on the replicas of several processes.

One process per worker, launched by ``mpiexec``; each runs its local replicas as
``MirroredStrategy`` does, and the reduction engine adds a cross-worker step to every
collective (``aioreplica._cluster``). This facade adds what is about workers: global replica
ids, variables that start from the chief's values, a failure on any worker ending ``run()`` on
every worker, and refusing concurrent runs (their collectives would interleave differently on
different workers).
"""

from __future__ import annotations

import functools
import math
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, SupportsIndex, TypeVar, final

import anyio

from ._backends import share_cores
from ._cluster import (
    ClusterBroken,
    Workers,
    WorkersDisagree,
    current_step,
    error_line,
    install_abort_on_uncaught,
)
from ._collectives import ReductionEngine
from ._dataset import InputContext
from ._errors import ReplicaSyncError, as_integer, as_real, checked_integer
from ._options import DEFAULT_PACK_BYTES
from ._strategy import MirroredStrategy
from ._values import DistributedValues, PerReplica, regroup
from ._variables import sync_variables

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from contextvars import Token

    from ._backends import Device
    from ._options import CommunicationOptions

__all__ = ["Cluster", "ClusterSpec", "MultiWorkerMirroredStrategy"]

_T = TypeVar("_T")


@final
class ClusterSpec(Mapping[str, list[str] | dict[int, str]]):
    """The workers as jobs of tasks, as TF's ``tf.train.ClusterSpec`` shows them: what
    ``cluster_resolver.cluster_spec()`` returns.

    A read-only mapping from each job's name to its tasks' addresses: a list in task order
    where the job's task indices are 0 to n - 1, else (a sparse job, as TF allows: a server
    configured without the addresses of every other task) a dict from task index to address,
    as TF's ``as_dict`` gives them (a new list or dict at each look, so changing one changes
    nothing here; a job without tasks reads as it was given, ``[]`` or ``{}``). It is equal
    to a dict that holds the same, however each job's tasks are written (a list or a mapping),
    so code that looked up, iterated or compared the spec as a dict keeps working (it is no
    dict: give ``as_dict()`` to ``json.dumps``, as for TF's).
    Jobs are sorted by name, as TF sorts them. Under MPI the one job is ``"worker"``, whose
    tasks are named by MPI rank.

    Args:
        cluster: each job's name and its tasks' addresses: a sequence, by task index, or a
            mapping from task index to address; as in TF, a task index may be a string of
            its digits, as JSON writes the keys of ``{1: "host1:2222"}``.

    Raises:
        TypeError: ``cluster`` is not a mapping of job names (``str``) to sequences of
            addresses (``str``) or mappings of task indices (``int``) to addresses.
        ValueError: a task index is negative or a string of other than digits, or two give
            the same index (``1`` and ``"1"``).

    Example:
        >>> spec = ClusterSpec({"worker": ["rank 0", "rank 1"]})
        >>> spec.jobs, spec.task_indices("worker"), spec.task_address("worker", 1)
        (['worker'], [0, 1], 'rank 1')
        >>> spec.as_dict()
        {'worker': ['rank 0', 'rank 1']}
        >>> sparse = ClusterSpec({"worker": {1: "host1:2222"}, "ps": ["host0:2222"]})
        >>> sparse.as_dict(), sparse.num_tasks("worker"), sparse.task_indices("worker")
        ({'ps': ['host0:2222'], 'worker': {1: 'host1:2222'}}, 1, [1])
        >>> import json
        >>> ClusterSpec(json.loads('{"worker": {"1": "host1:2222"}}')).as_dict()
        {'worker': {1: 'host1:2222'}}
    """

    __slots__ = ("_empty_lists", "_jobs")

    def __init__(self, cluster: Mapping[str, Sequence[str] | Mapping[int, str]]) -> None:
        if not isinstance(cluster, Mapping):
            raise TypeError(
                "ClusterSpec: cluster must be a mapping of job names to lists of task "
                f"addresses, got {type(cluster).__name__} {cluster!r:.60}"
            )
        jobs: dict[str, dict[int, str]] = {}
        for job, tasks in cluster.items():
            if not isinstance(job, str):
                raise TypeError(
                    f"ClusterSpec: job names must be str, got {type(job).__name__} {job!r:.60}"
                )
            jobs[job] = dict(sorted(_job_tasks(job, tasks).items()))
        self._jobs = dict(sorted(jobs.items()))
        # TF's as_dict shows a job without tasks as {}; looked up, it stays the [] it was
        # given.
        self._empty_lists = frozenset(
            job for job, tasks in cluster.items() if not tasks and not isinstance(tasks, Mapping)
        )

    def __getitem__(self, job: str) -> list[str] | dict[int, str]:
        if job in self._empty_lists:
            return []
        return _as_given(self._jobs[job])

    def __iter__(self) -> Iterator[str]:
        return iter(self._jobs)

    def __eq__(self, other: object) -> bool:
        """Equal to a ``ClusterSpec``, or a mapping that makes one, of the same jobs and
        tasks, however each job's tasks are written (a list or a mapping, ``[]`` or ``{}``)."""
        if not isinstance(other, Mapping):
            return NotImplemented
        if not isinstance(other, ClusterSpec):
            try:
                other = ClusterSpec(other)
            except (TypeError, ValueError):  # no cluster: not equal
                return False
        return self._jobs == other._jobs

    __hash__ = None  # type: ignore[assignment]  # equal to dicts, which do not hash

    def __len__(self) -> int:
        return len(self._jobs)

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"

    @property
    def jobs(self) -> list[str]:
        """The jobs' names, sorted."""
        return list(self._jobs)

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """Each job's name and its tasks' addresses, as a new dict (TF's ``as_dict``): a
        list for a job whose task indices are 0 to n - 1, a dict from task index to address
        for a sparse one (and for a job without tasks, as TF's).

        Example:
            >>> ClusterSpec({"worker": ["rank 0"]}).as_dict()
            {'worker': ['rank 0']}
            >>> ClusterSpec({"worker": {2: "host2:2222"}}).as_dict()
            {'worker': {2: 'host2:2222'}}
        """
        return {job: _as_given(tasks) for job, tasks in self._jobs.items()}

    def num_tasks(self, job_name: str) -> int:
        """How many tasks ``job_name`` has: the tasks given, of a sparse job too.

        Raises:
            ValueError: no job is named ``job_name``.

        Example:
            >>> ClusterSpec({"worker": ["rank 0", "rank 1"]}).num_tasks("worker")
            2
            >>> ClusterSpec({"worker": {3: "host3:2222"}}).num_tasks("worker")
            1
        """
        return len(self._tasks(job_name, "num_tasks"))

    def task_indices(self, job_name: str) -> list[int]:
        """The indices of ``job_name``'s tasks, in order.

        Raises:
            ValueError: no job is named ``job_name``.

        Example:
            >>> ClusterSpec({"worker": ["rank 0", "rank 1"]}).task_indices("worker")
            [0, 1]
            >>> ClusterSpec({"worker": {3: "host3:2222", 1: "host1:2222"}}).task_indices("worker")
            [1, 3]
        """
        return list(self._tasks(job_name, "task_indices"))

    def job_tasks(self, job_name: str) -> list[str | None]:
        """The addresses of ``job_name``'s tasks, by task index: as TF's, a list from index 0
        to the highest index, with ``None`` for an index a sparse job does not give (so its
        length need not be ``num_tasks``).

        Raises:
            ValueError: no job is named ``job_name``.

        Example:
            >>> ClusterSpec({"worker": ["rank 0", "rank 1"]}).job_tasks("worker")
            ['rank 0', 'rank 1']
            >>> ClusterSpec({"worker": {1: "host1:2222"}}).job_tasks("worker")
            [None, 'host1:2222']
        """
        tasks = self._tasks(job_name, "job_tasks")
        return [tasks.get(index) for index in range(max(tasks, default=-1) + 1)]

    def task_address(self, job_name: str, task_index: int) -> str:
        """The address of task ``task_index`` of ``job_name``.

        Raises:
            ValueError: no job is named ``job_name``, or it has no task ``task_index``.
            TypeError: ``task_index`` is not an int.

        Example:
            >>> ClusterSpec({"worker": ["rank 0", "rank 1"]}).task_address("worker", 1)
            'rank 1'
        """
        tasks = self._tasks(job_name, "task_address")
        index = as_integer(task_index)
        if index is None:
            raise TypeError(
                f"ClusterSpec.task_address: task_index must be an int, got "
                f"{type(task_index).__name__} {task_index!r:.60}"
            )
        if index not in tasks:
            raise ValueError(
                f"ClusterSpec.task_address: no task with index {index} in job {job_name!r}, "
                f"{_whose_tasks(list(tasks))}"
            )
        return tasks[index]

    def _tasks(self, job_name: str, what: str) -> dict[int, str]:
        tasks = self._jobs.get(job_name)
        if tasks is None:
            jobs = ", ".join(map(repr, self._jobs)) or "none"
            raise ValueError(
                f"ClusterSpec.{what}: no such job in the cluster: {job_name!r}; its jobs are {jobs}"
            )
        return tasks


def _job_tasks(job: str, tasks: object) -> dict[int, str]:
    """A job's tasks as given to ``ClusterSpec``, by task index: from a sequence of addresses
    or a mapping of task indices to addresses (TF's sparse form)."""
    expected = (
        f"ClusterSpec: job {job!r} must have a sequence of task addresses (str) or a mapping "
        "of task indices (int) to addresses"
    )
    if isinstance(tasks, Mapping):
        by_index: dict[int, str] = {}
        given: dict[int, object] = {}
        for key, address in tasks.items():
            if isinstance(key, str) and isinstance(address, str):
                # JSON keys are strings: TF takes int(key), and so does this, for digits alone.
                if not (key.isascii() and key.isdigit()):
                    raise ValueError(
                        f"ClusterSpec: job {job!r} has a task with index {key!r}; task indices "
                        "are ints >= 0, or strings of their digits (as JSON keys)"
                    )
                index: int | None = int(key)
            else:
                index = as_integer(key)
            if index is None or not isinstance(address, str):
                raise TypeError(f"{expected}, got {type(tasks).__name__} {tasks!r:.60}")
            if index < 0:
                raise ValueError(
                    f"ClusterSpec: job {job!r} has a task with index {index}; task indices "
                    "are ints >= 0"
                )
            if index in given:
                raise ValueError(
                    f"ClusterSpec: job {job!r} gives task {index} twice, as {given[index]!r} "
                    f"and {key!r}; give each task index once"
                )
            given[index] = key
            by_index[index] = address
        return by_index
    if (
        isinstance(tasks, (str, bytes))
        or not isinstance(tasks, Sequence)
        or not all(isinstance(task, str) for task in tasks)
    ):
        raise TypeError(f"{expected}, got {type(tasks).__name__} {tasks!r:.60}")
    return dict(enumerate(tasks))


def _as_given(tasks: dict[int, str]) -> list[str] | dict[int, str]:
    """A job's tasks as TF's ``as_dict`` shows them: a list where the task indices are 0 to
    n - 1, else a dict (an empty one for a job without tasks)."""
    if tasks and max(tasks) + 1 == len(tasks):
        return list(tasks.values())
    return dict(tasks)


def _whose_tasks(indices: list[int]) -> str:
    """The end of a message about a task that a job lacks: which tasks it has."""
    if not indices:
        return "which has no tasks"
    if indices[-1] + 1 == len(indices):
        return f"whose tasks are 0 to {indices[-1]}"
    return f"whose tasks are {', '.join(map(str, indices))}"


@final
@dataclass(frozen=True, slots=True)
class Cluster:
    """Where this process stands among the workers of a ``MultiWorkerMirroredStrategy``.

    It is also the strategy's ``cluster_resolver``, with the parts of TF's
    ``ClusterResolver`` that mean something under MPI: ``task_type``, ``task_id``,
    ``cluster_spec()``, ``master()``, ``num_accelerators()``, ``rpc_layer`` and
    ``environment``.

    Attributes:
        worker_index: this worker's index, from 0 (its MPI rank in the strategy's
            communicator).
        num_workers: how many workers (processes) run the strategy.
        gpus: how many of this worker's replicas are on GPUs.

    Raises:
        TypeError: a field is not an int (NumPy's integers are; a bool is not).
        ValueError: ``num_workers`` is below 1, ``gpus`` negative, or ``worker_index`` not
            from 0 to ``num_workers - 1``.

    Example:
        >>> Cluster(worker_index=0, num_workers=2).is_chief
        True
    """

    worker_index: int
    num_workers: int
    gpus: int = 0

    def __post_init__(self) -> None:
        workers = checked_integer(self.num_workers, "Cluster: num_workers must be an int >= 1", 1)
        index = checked_integer(self.worker_index, "Cluster: worker_index must be an int >= 0", 0)
        if index >= workers:
            raise ValueError(
                f"Cluster: worker_index {index} is not one of the {workers} workers' indices, "
                f"0 to {workers - 1}"
            )
        gpus = checked_integer(self.gpus, "Cluster: gpus must be an int >= 0", 0)
        # NumPy's integers as Python ints, so that clusters compare and print as ints.
        object.__setattr__(self, "num_workers", workers)
        object.__setattr__(self, "worker_index", index)
        object.__setattr__(self, "gpus", gpus)

    @property
    def is_chief(self) -> bool:
        """Whether this is worker 0, which writes checkpoints and numbers them."""
        return self.worker_index == 0

    @property
    def task_type(self) -> str:
        """``"worker"``: TF's name for this process's job in a cluster without a ``"chief"``
        job, where worker 0 is the chief (for code written against TF's
        ``strategy.cluster_resolver``)."""
        return "worker"

    @property
    def task_id(self) -> int:
        """``worker_index``, under TF's name."""
        return self.worker_index

    @property
    def rpc_layer(self) -> None:
        """``None``: the workers talk through MPI, not an RPC layer (TF's ``"grpc"``), so
        there is no protocol to put ahead of an address."""
        return None

    @property
    def environment(self) -> str:
        """``""``: TF's answer outside Google's internal environment."""
        return ""

    def cluster_spec(self) -> ClusterSpec:
        """TF's cluster spec: one ``"worker"`` job with one task per worker, named by its MPI
        rank (workers under MPI have ranks, not the network addresses of TF's). A read-only
        mapping, equal to the dict it holds.

        Example:
            >>> spec = Cluster(worker_index=0, num_workers=2).cluster_spec()
            >>> spec
            ClusterSpec({'worker': ['rank 0', 'rank 1']})
            >>> spec.num_tasks("worker"), spec == {"worker": ["rank 0", "rank 1"]}
            (2, True)
        """
        return ClusterSpec({"worker": [f"rank {i}" for i in range(self.num_workers)]})

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """``""``: there is no gRPC master to connect to (TF's answer for a local cluster).

        A task named by ``task_type`` and ``task_id`` (both given, as TF reads them) must be
        one of the cluster's, as TF's ``ClusterSpec.task_address`` requires. ``rpc_layer``
        (TF's protocol prefix, such as ``"grpc"``) is accepted and changes nothing: there is
        no address to prefix.

        Raises:
            ValueError: ``task_type`` is not ``"worker"``, or ``task_id`` not a worker's
                index, from 0 to ``num_workers - 1``.
            TypeError: ``task_id`` is not an int.

        Example:
            >>> Cluster(worker_index=0, num_workers=2).master()
            ''
            >>> Cluster(worker_index=0, num_workers=2).master("worker", 1)
            ''
        """
        self._check_task("master()", task_type, task_id)
        return ""

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        """This worker's accelerators, as TF's: ``{"GPU": n}`` for the GPUs its replicas use,
        ``{}`` for host replicas (every worker has as many). ``task_type``, ``task_id`` and
        ``config_proto`` are TF's and accepted: every worker has the same devices, so the
        answer is the same for any task of the cluster; a task named by both ``task_type``
        and ``task_id`` must be one, as for ``master()``.

        Raises:
            ValueError: ``task_type`` is not ``"worker"``, or ``task_id`` not a worker's
                index, from 0 to ``num_workers - 1``.
            TypeError: ``task_id`` is not an int.

        Example:
            >>> Cluster(worker_index=0, num_workers=2, gpus=4).num_accelerators()
            {'GPU': 4}
            >>> Cluster(worker_index=0, num_workers=2, gpus=4).num_accelerators("worker", 1)
            {'GPU': 4}
        """
        self._check_task("num_accelerators()", task_type, task_id)
        return {"GPU": self.gpus} if self.gpus else {}

    def _check_task(self, what: str, task_type: str | None, task_id: int | None) -> None:
        """Refuse a task, named by both ``task_type`` and ``task_id`` (one alone is ignored,
        as in TF), that is not one of the cluster's."""
        if task_type is None or task_id is None:
            return
        if task_type != "worker":
            raise ValueError(
                f"{what}: no such job in the cluster: {task_type!r}; its one job is 'worker'"
            )
        index = as_integer(task_id)
        if index is None:
            raise TypeError(
                f"{what}: task_id must be an int, got {type(task_id).__name__} {task_id!r:.60}"
            )
        if not 0 <= index < self.num_workers:
            raise ValueError(
                f"{what}: no task with index {index} in job 'worker', whose tasks are "
                f"0 to {self.num_workers - 1}"
            )


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """``MirroredStrategy`` over the replicas of several processes (workers), under MPI.

    Launch one process per worker with ``mpiexec -n W python program.py`` (the ``mpiexec`` of
    the environment where ``pip install 'aioreplica[mpi]'`` put mpi4py and MPICH). Every worker
    builds the strategy at the same point of its program with as many local devices; a
    replica's id is global and worker-major (worker ``w``'s local replica ``j`` is ``w * L +
    j``), while ``run()``'s arguments and results stay local: one component per local replica.
    Collectives (``ctx.all_reduce`` and the others, ``strategy.reduce``, ``gather``,
    ``extended.reduce_to``) combine over every worker; ``merge_fn`` runs once per worker, on
    that worker's ``PerReplica``. Each global batch of ``distribute_dataset`` is cut in
    ``num_replicas_in_sync`` slices, of which a worker takes its replicas'.

    Variables made in ``scope()`` start from the chief's initial value (fetched before their
    first use in ``run()``, or at their first read, which every worker must then make).
    Checkpoints are collective: the chief writes, every worker returns once the file is
    complete (the workers must share the file system).

    A failure on one worker (an exception in a replica or ``merge_fn``, a cancelled
    ``run()``) makes ``run()`` raise on every worker: its own exception on the failing one,
    ``ReplicaSyncError`` naming the failing worker on the others, which learn of it through a
    side channel while they wait. ``sync_timeout`` (and a collective's ``timeout_seconds``)
    bounds every wait for another worker too. MPI cannot cancel a collective, so after such a
    failure the strategy refuses further cross-worker calls. An uncaught exception ends the
    whole job (``MPI_Abort``) instead of leaving the other workers waiting. Bad input is no
    failure: arguments that ``run()`` or a collective refuses on some workers raise there, and
    a ``ValueError`` naming them on the others, in step; the strategy goes on working.

    Args:
        devices: this worker's local devices, as for ``MirroredStrategy``.
        communicator: an mpi4py intracommunicator of the workers (default
            ``MPI.COMM_WORLD``); the strategy works on duplicates of it, so the caller's own
            traffic on it is never disturbed. A rank given ``MPI.COMM_NULL`` (not in the
            communicator: ``Split`` left it out) raises ``TypeError`` at once, and the ranks
            in the communicator go on without it. Given something that is no communicator, a
            worker raises ``TypeError`` once it has told the others, which it looks for on
            ``MPI.COMM_WORLD``: if they are on another communicator, that wait ends after
            ``sync_timeout`` (and its error notes that they were not told; the refusal stays
            posted on ``MPI.COMM_WORLD``, so end the job), and without one it lasts until they
            all make a strategy on ``MPI.COMM_WORLD``.
        communication_options: defaults for collectives (packing, timeout); every worker
            passes the same ``bytes_per_pack``, which decides what each collective carries.
        sync_timeout: seconds a replica, or a worker, may wait for the others to arrive.
        interleave: as for ``MirroredStrategy``.
        seed: as for ``MirroredStrategy``.
        slow_merge_warning: as for ``MirroredStrategy``.

    Raises:
        ImportError: mpi4py is not installed (``pip install 'aioreplica[mpi]'``).
        ValueError: the workers have different numbers of local replicas, or different
            ``bytes_per_pack`` in their ``communication_options`` (on every worker, naming
            each worker's); and as ``MirroredStrategy``.
        TypeError: ``communicator`` is not an mpi4py intracommunicator, or is
            ``MPI.COMM_NULL`` (this rank is not in it, or it was freed); and as
            ``MirroredStrategy``.

    Example:
        >>> strategy = aioreplica.MultiWorkerMirroredStrategy(["cpu:0", "cpu:1"])  # one process
        >>> strategy.cluster.num_workers, strategy.num_replicas_in_sync
        (1, 2)
        >>> async def step():
        ...     ctx = aioreplica.get_replica_context()
        ...     return await ctx.all_reduce("sum", ctx.replica_id_in_sync_group)
        >>> int(anyio.run(strategy.run, step))
        1
    """

    def __init__(
        self,
        devices: Sequence[str | Device] | None = None,
        *,
        communicator: Any = None,
        communication_options: CommunicationOptions | None = None,
        sync_timeout: float | None = None,
        interleave: Literal["ordered", "random"] = "ordered",
        seed: SupportsIndex | None = None,
        slow_merge_warning: float | None = 60.0,
    ) -> None:
        self._communicator = communicator
        # How long a refusal may wait for the other workers where it guesses their
        # communicator (``Workers.refuse``): the sync_timeout, if it is a valid one.
        seconds = as_real(sync_timeout)
        valid = seconds is not None and seconds > 0 and math.isfinite(seconds)
        self._refusal_timeout = seconds if valid else None
        self._joined = False  # whether this worker reached the workers' first agreement
        # The merge functions of the last run() that made merge calls, and its end's words.
        self._merged_before: list[Callable[..., Any]] = []
        self._merged_words = _END_OF_RUN
        try:
            super().__init__(
                devices,
                sync_timeout=sync_timeout,
                interleave=interleave,
                seed=seed,
                communication_options=communication_options,
                slow_merge_warning=slow_merge_warning,
            )
        except Exception as exc:
            if not self._joined:  # refused here alone: the other workers must not wait
                Workers.refuse(communicator, exc, self._refusal_timeout)
            raise
        workers = self._workers
        workers.default_timeout = sync_timeout
        gpus = sum(device.kind == "gpu" for device in self._device_objects)
        self._cluster = Cluster(workers.worker_index, workers.num_workers, gpus)
        share_cores(workers.workers_here)
        if workers.num_workers > 1:
            install_abort_on_uncaught(workers.mpi.COMM_WORLD)

    def _new_engine(
        self, devices: tuple[Device, ...], options: CommunicationOptions
    ) -> ReductionEngine:
        self._joined = True
        self._workers = Workers(
            self._communicator,
            len(devices),
            options.bytes_per_pack or DEFAULT_PACK_BYTES,
            self._refusal_timeout,
        )
        return ReductionEngine(devices, options, self._workers)

    # -- facts ----------------------------------------------------------------------------

    @property
    def cluster(self) -> Cluster:
        """This worker's index, the number of workers, and whether this is the chief."""
        return self._cluster

    @property
    def cluster_resolver(self) -> Cluster:
        """``cluster``, under TF's name: ``strategy.cluster_resolver.task_type`` and
        ``.task_id`` work as in TF's multi-worker programs (``None`` in one process, as TF's
        ``MirroredStrategy`` has none)."""
        return self._cluster

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """Return this worker's components of ``value``, one per local replica, as in TF.

        As ``MirroredStrategy.experimental_local_results``: a distributed value holds this
        worker's replicas' values only, so a ``PerReplica`` with another number of values (the
        global number, say) is refused.

        Raises:
            ValueError: ``value`` is a ``PerReplica`` that does not hold one value per local
                replica.

        Example:
            >>> strategy = aioreplica.MultiWorkerMirroredStrategy(["cpu:0", "cpu:1"])
            >>> strategy.experimental_local_results(aioreplica.PerReplica([1, 2]))
            (1, 2)
        """
        if isinstance(value, PerReplica) and len(value.values) != len(self._device_objects):
            raise ValueError(
                f"experimental_local_results takes this worker's values: a PerReplica of "
                f"{len(value.values)} values, but worker {self._cluster.worker_index} has "
                f"{len(self._device_objects)} local replicas (num_replicas_in_sync is "
                f"{self.num_replicas_in_sync} over all workers): a distributed value holds "
                "this worker's replicas' values only"
            )
        return super().experimental_local_results(value)

    def _input_context(self) -> InputContext:
        return InputContext(
            num_input_pipelines=self._cluster.num_workers,
            input_pipeline_id=self._cluster.worker_index,
            num_replicas_in_sync=self.num_replicas_in_sync,
        )

    def _worker_index(self) -> int:
        return self._cluster.worker_index

    def __repr__(self) -> str:
        cluster = self._cluster
        return (
            f"MultiWorkerMirroredStrategy(devices={list(self.devices)!r}, worker "
            f"{cluster.worker_index} of {cluster.num_workers})"
        )

    # -- running --------------------------------------------------------------------------

    async def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        options: None = None,
    ) -> Any:
        """Run ``fn`` once per local replica of every worker; return this worker's results.

        As ``MirroredStrategy.run``, with the arguments and results local. Every worker calls
        it; they leave it together: the end of ``run()`` is a cross-worker agreement, so a
        failure on any worker reaches every worker's ``run()``. Started while another task's
        cross-worker call (a ``strategy.reduce``, a save) is in progress, it starts its
        replicas once that call has ended.

        Arguments refused on one worker (a ``PerReplica`` of the wrong length, say, or a
        collective's: an unknown op, ``MEAN`` of integers) make ``run()`` raise on every
        worker: that error on the worker that refused them, a ``ValueError`` naming it on the
        others, at the first point where they agree; every worker stays in step and the
        strategy goes on working.

        Raises:
            RuntimeError: another ``run()`` of this strategy is in progress on this worker; the
                workers fell out of step earlier (the strategy makes no more cross-worker
                calls); and as ``MirroredStrategy.run``.
            ValueError: a distributed argument does not have one value per local replica; or
                another worker refused its arguments (``WorkersDisagree``, naming it).
            TypeError: as ``MirroredStrategy.run`` (on this worker; the others raise
                ``WorkersDisagree``).
            ReplicaSyncError: another worker failed (naming it, its replica and what it
                raised), or a worker was late past ``sync_timeout``; or the workers' replicas
                made different merge calls (how many, which merge functions, in which order:
                each worker runs its own ``merge_fn``, so the workers compare them at the end
                of ``run()``), on every worker, naming what each made; the merge functions
                ran, so the strategy then makes no more cross-worker calls.
            BaseException: what this worker's replica or ``merge_fn`` raised, as
                ``MirroredStrategy.run``.

        Example:
            >>> strategy = aioreplica.MultiWorkerMirroredStrategy(["cpu:0"])
            >>> anyio.run(strategy.run, lambda: aioreplica.get_replica_context().device.name)
            'cpu:0'
        """
        try:
            parts = self._prepare_run(fn, args, kwargs, options)
        except (TypeError, ValueError, RuntimeError) as exc:  # bad input, closed, in a run
            await self._refuse_step(exc, "run()")
            raise
        workers = self._workers
        if workers.step is not None or workers.broken:
            self._check_usable("run()")
        # The step: the replicas, then the agreement that every worker's step succeeded. A
        # failure is announced to the other workers, unless it is bad input: arguments that a
        # replica's check refused (``ReductionEngine.refusing``) are refused in step here,
        # where the worker's next collective would be. The step is written out here, with
        # ``_in_progress()``'s work, rather than called: every run() pays for each call, which
        # counts in an 8-byte step (devices/bench_multiworker.py).
        workers.refused = None
        if workers.refusing:
            workers.refusing.clear()
        step = workers.step = object()
        reset = current_step.set(step)
        held = False
        try:
            try:
                if workers.calling:
                    held = await workers.hold()
                if workers.pending:
                    await sync_variables(workers)
                merged: list[Callable[..., Any]] = []
                result = await self._scheduler.run(fn, parts, merged)
                # The workers compare their merge calls here: a merge function makes no
                # cross-worker collective of its own, so one that differs, or is skipped, on
                # some workers would go unnoticed. The words for the run's merge functions are
                # made once while they stay the same (the built-in collectives' do).
                if not merged:
                    words = _END_OF_RUN
                elif merged == self._merged_before:
                    words = self._merged_words
                else:
                    words = self._merged_words = _end_of_run(merged)
                    self._merged_before = merged
                try:
                    await workers.barrier(words)
                except WorkersDisagree as disagreement:
                    mismatch = self._merges_differ(disagreement)
                    if mismatch is None:
                        raise
                    # Raised on every worker in step, but after merge functions that ran
                    # apart (their writes may differ between workers): a failure, after which
                    # the strategy makes no more cross-worker calls.
                    raise mismatch from disagreement
            except BaseException as exc:
                for what, error in workers.refusing:
                    if error is exc:  # a replica's check of a collective's arguments
                        await self._engine.refuse(what, exc)
                        break
                raise
            finally:
                if held:
                    workers.let_go()
                current_step.reset(reset)
                workers.step = None
        except BaseException as exc:  # cancelled while a call ended counts, too
            self._failed(exc)
            raise
        return regroup(result, first_replica=self._engine.first_replica)

    async def run_steps(self, step_fn: Callable[[Any], Any], iterator: Any, steps: int) -> Any:
        """``MirroredStrategy.run_steps`` on every worker; they leave it together.

        The workers first agree that every one of them accepted its arguments and was given
        the same ``steps``: arguments refused on one worker (``steps=-1``, say), or another
        ``steps`` on one worker, make ``run_steps()`` raise on every worker, as ``run()`` does,
        before any step or any pull from the iterator; the strategy goes on working.

        Raises:
            RuntimeError: as ``run()``.
            ValueError: another worker refused its arguments (``WorkersDisagree``, naming it);
                the workers were given different ``steps`` (``WorkersDisagree``, on every
                worker, naming each worker's).
            ReplicaSyncError: as ``run()``.
            BaseException: as ``MirroredStrategy.run_steps``.

        Example:
            >>> strategy = aioreplica.MultiWorkerMirroredStrategy(["cpu:0", "cpu:1"])
            >>> batches = aioreplica.batched(np.arange(8.0), 4)
            >>> async def loop():
            ...     iterator = aiter(strategy.distribute_dataset(batches))
            ...     return await strategy.run_steps(lambda x: float(x.sum()), iterator, 2)
            >>> anyio.run(loop)
            PerReplica({0: 9.0, 1: 13.0})
        """
        # The steps are one run() of replicas that loop: that run() is the collective step.
        return await MirroredStrategy.run_steps(self, step_fn, iterator, steps)

    async def _accepted(
        self, what: str, check: Callable[[], tuple[_T, int]], counted: str
    ) -> tuple[_T, int]:
        """``check()`` (what it accepted, and the number of steps: the argument ``counted``),
        once every worker's check of its arguments to ``what`` passed and every worker was
        given the same number of steps: an agreement that compares the numbers, or (refused
        here) a refusal in its place, so that every worker raises in step. Else a worker alone
        would raise, and the others would wait for it in the first pull from their iterators,
        which is not on the strategy's communicator; and a worker with more steps than the
        others would pair its extra steps with their next calls.

        Raises:
            TypeError: as ``check()`` (the other workers raise ``WorkersDisagree``).
            ValueError: as ``check()``; another worker refused, or the workers were given
                different numbers of steps (``WorkersDisagree``, on every worker alike).
            RuntimeError: as ``run()``.
            ReplicaSyncError: another worker failed, or was late past ``sync_timeout``.
        """
        self._check_usable(what)
        try:
            self._check_open(what)
            accepted, count = check()
        except (TypeError, ValueError, RuntimeError) as exc:  # bad input, closed
            await self._refuse_step(exc, what)
            raise
        start = f"the start of {what}"
        async with self._in_progress():
            try:
                await self._workers.barrier(start, f" with {counted}={count}")
            except WorkersDisagree as disagreement:
                differ = _counts_differ(what, start, counted, disagreement)
                if differ is None:
                    raise
                raise differ from disagreement
        return accepted, count

    def _wrong_length(self, name: str, leaf: DistributedValues[Any]) -> ValueError:
        local = len(self._device_objects)
        return ValueError(
            f"run() takes this worker's values: {name} is a {type(leaf).__name__} of "
            f"{len(leaf.values)} values, but it needs one value per local replica ({local} on "
            f"worker {self._cluster.worker_index}; num_replicas_in_sync is "
            f"{self.num_replicas_in_sync} over all workers): each worker passes its own "
            "replicas' values"
        )

    def _merges_differ(self, disagreement: WorkersDisagree) -> ReplicaSyncError | None:
        """The error for the end of a ``run()`` where every worker arrived, after merge calls
        that differ (``disagreement``, from the end's agreement, names what each worker made);
        ``None`` if some worker made another collective there (``disagreement`` says so).
        Made from what every worker sent, so the same on every worker."""
        said = disagreement.said
        num_workers = self._cluster.num_workers
        if len(said) != num_workers or not all(w.startswith(_END_OF_RUN) for w in said):
            return None
        made = [_merges_made(words.removeprefix(_END_OF_RUN)) for words in said]
        differ = [w for w in range(1, num_workers) if made[w] != made[0]]
        local = len(self._device_objects)
        shown = "; ".join(f"worker {w}: {made[w]}" for w in range(num_workers))
        return ReplicaSyncError(
            f"the workers' replicas made different merge calls in this run() ({shown}); every "
            "replica of every worker must make the same merge_calls, with the same merge "
            "functions, in the same order: move merge_call out of worker-dependent branches "
            "(merge_fn runs once on each worker, so the workers compare their merge calls at the "
            "end of run())",
            merge_number=None,
            replicas=[w * local + j for w in differ for j in range(local)],
            workers=differ,
        )

    async def _refuse_step(self, error: BaseException, what: str) -> None:
        """Take part in this step's first agreement as a worker whose ``run()`` (or other
        ``what``) refused its arguments (``error``), so that the other workers' call raises
        too, naming this worker, rather than waiting for it or pairing with its next step.

        A closed strategy's ``run()`` refuses too (``close()`` stops this worker's threads, not
        its part in the collectives). Nothing to agree when the cluster is broken, or from
        inside a run (whose collectives this would join).
        """
        if self._running or self._workers.broken:
            return
        async with self._in_progress():
            await self._workers.refuse_in_step(what, error)

    async def _sync_new_variables(self) -> None:
        if not self._workers.pending:
            return
        try:
            await sync_variables(self._workers)
        except BaseException as exc:
            self._failed(exc)
            raise

    def _check_usable(self, what: str) -> None:
        if self._closed:
            return  # MirroredStrategy's own check says so
        self._workers.check(what)
        if self._running:
            raise RuntimeError(
                f"{what} was called on {self!r} while another run() is in progress on this "
                "worker; the workers must make their collectives in the same order, which "
                "concurrent runs would not keep: await one run() before starting the next"
            )

    @property
    def _running(self) -> bool:
        """Whether a ``run()``, or an agreement that stands in for one, is in progress."""
        return self._workers.step is not None

    def _in_progress(self) -> _InProgress:
        """Mark a ``run()`` in progress, or an agreement that stands in for one, for the block:
        ``_check_usable`` refuses another ``run()`` meanwhile, and the communicator any
        collective from another task, since they could reach MPI in another order on another
        worker. The block starts once a call that another task has in progress (a
        ``strategy.reduce``, a save) has ended."""
        return _InProgress(self._workers)

    def _failed(self, exc: BaseException) -> None:
        """Tell the other workers that this one failed: unless it is a peer's failure, or
        bad input that every worker raised on in step (refused arguments, ``WorkersDisagree``),
        which breaks nothing."""
        workers = self._workers
        if exc is workers.refused:
            workers.refused = None
            return
        if workers.broken or isinstance(exc, (ClusterBroken, WorkersDisagree)):
            return
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            workers.announce("its run() was cancelled")
            return
        place = ""
        replicas: tuple[int, ...] = ()
        for note in getattr(exc, "__notes__", ()):
            found = _REPLICA_NOTE.search(note)
            if found is not None:
                replicas = (int(found.group(1)),)
                place = f" in replica {found.group(1)}"
                break
        reason = f"{error_line(exc)} was raised{place}"
        if isinstance(exc, ReplicaSyncError) and not place:
            replicas = exc.replicas
        workers.announce(reason, replicas)


class _InProgress:
    """``MultiWorkerMirroredStrategy._in_progress`` (``run()`` writes the same out).

    The step is a token: the communicator's ``step`` while it runs, and ``current_step`` in
    its task, which the replicas' and merges' tasks inherit; a collective made from another
    task meanwhile is refused (``Workers._begin``), as is another task's call
    (``Workers.call``). A call that another task has in progress ends first: the step then
    holds the communicator as a call does (``Workers.hold``)."""

    __slots__ = ("_held", "_reset", "_workers")

    def __init__(self, workers: Workers) -> None:
        self._workers = workers
        self._reset: Token[object | None] | None = None
        self._held = False

    async def __aenter__(self) -> None:
        workers = self._workers
        step = workers.step = object()
        self._reset = current_step.set(step)
        if workers.calling:
            try:
                self._held = await workers.hold()
            except BaseException:
                self._leave()
                raise

    async def __aexit__(self, *exc_info: object) -> None:
        if self._held:
            self._workers.let_go()
        self._leave()

    def _leave(self) -> None:
        if self._reset is not None:
            current_step.reset(self._reset)
        self._workers.step = None


_REPLICA_NOTE = re.compile(r"raised in replica (\d+) of")

#: The end of a ``run()`` that made no merge call, as the workers agree on it.
_END_OF_RUN: Final = "the end of run()"


def _end_of_run(merged: list[Callable[..., Any]]) -> str:
    """The words of the end of a ``run()`` whose merge rounds ran ``merged``, the same in every
    process that ran the same ones: their count, their merge functions' qualified names, each
    once in the order of first use (the part of the words a message shows), and a checksum of
    the whole sequence by module and qualified name (so another order, or a function of the
    same name from another module, differs too). No colon: the workers' agreement shows
    ``what`` ahead of one."""
    named = [_merge_fn_name(fn) for fn in merged]
    shown = ", ".join(dict.fromkeys(name for _, name in named))
    sequence = zlib.crc32(" ".join(f"{module}.{name}" for module, name in named).encode())
    count = len(named)
    return (
        f"{_END_OF_RUN} after {count} merge_call{'' if count == 1 else 's'} of {shown} "
        f"(sequence {sequence:08x})"
    )


def _counts_differ(
    what: str, start: str, counted: str, disagreement: WorkersDisagree
) -> WorkersDisagree | None:
    """The error of the start of a loop of steps (``what``, whose agreement is named ``start``)
    where every worker accepted its arguments but the numbers of steps (the argument
    ``counted``) differ; ``None`` if some worker refused its arguments or made another
    collective there (``disagreement`` says so). Made from what every worker sent, so the
    same on every worker."""
    said = disagreement.said
    given = f"{start} with "
    if not said or not all(words.startswith(given) for words in said):
        return None
    shown = "; ".join(f"worker {w}: {words.removeprefix(given)}" for w, words in enumerate(said))
    return WorkersDisagree(
        f"{what}: the workers were given different numbers of steps ({shown}); nothing was run "
        "or pulled from an iterator on any worker, and the workers are still in step: pass the "
        f"same {counted} on every worker (the workers make each step's collectives together, "
        "so a step more on one worker would meet the others' next call)",
        said=said,
    )


def _merges_made(said: str) -> str:
    """What a worker's end-of-run words (after ``_END_OF_RUN``) say it made, for a message."""
    return said.removeprefix(" after ") if said else "no merge_call"


def _merge_fn_name(fn: Callable[..., Any]) -> tuple[str, str]:
    """A merge function's module and qualified name (a partial's function's; a callable
    object's class's): the same in every process of one program."""
    inner: Any = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    inner = getattr(inner, "__func__", inner)  # a bound method's function
    name = getattr(inner, "__qualname__", None)
    if not isinstance(name, str):
        inner = type(inner)
        name = inner.__qualname__
    module = getattr(inner, "__module__", None)
    return (module if isinstance(module, str) else "", name)
