"""aioreplica: run one step function on many replicas at once, as coroutines on one event loop.

The public surface is re-exported here; every other module is private. See ``README.md``.
"""

from __future__ import annotations

import contextlib

from . import nest as nest
from . import optimizers as optimizers
from ._backends import Device as Device
from ._backends import list_devices as list_devices
from ._batched import BatchedIterator as BatchedIterator
from ._batched import batched as batched
from ._checkpoint import Checkpoint as Checkpoint
from ._checkpoint import CheckpointManager as CheckpointManager
from ._checkpoint import RestoreReport as RestoreReport
from ._checkpoint import latest_checkpoint as latest_checkpoint
from ._context import ReplicaContext as ReplicaContext
from ._context import get_cross_replica_context as get_cross_replica_context
from ._context import get_replica_context as get_replica_context
from ._context import in_cross_replica_context as in_cross_replica_context
from ._dataset import DistributedDataset as DistributedDataset
from ._dataset import DistributedIterator as DistributedIterator
from ._dataset import InputContext as InputContext
from ._dataset import InputOptions as InputOptions
from ._dataset import InputReplicationMode as InputReplicationMode
from ._dataset import OptionalValue as OptionalValue
from ._dataset import ValueContext as ValueContext
from ._errors import AioreplicaInternalError as AioreplicaInternalError
from ._errors import CheckpointError as CheckpointError
from ._errors import ClusterBroken as ClusterBroken
from ._errors import ReplicaSyncError as ReplicaSyncError
from ._errors import WorkersDisagree as WorkersDisagree
from ._losses import compute_average_loss as compute_average_loss
from ._losses import scale_regularization_loss as scale_regularization_loss
from ._multiworker import Cluster as Cluster
from ._multiworker import ClusterSpec as ClusterSpec
from ._multiworker import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from ._options import CommunicationImplementation as CommunicationImplementation
from ._options import CommunicationOptions as CommunicationOptions
from ._options import ReduceOp as ReduceOp
from ._scheduler import SchedulerStatistics as SchedulerStatistics
from ._steps import MultiStepContext as MultiStepContext
from ._strategy import MirroredStrategy as MirroredStrategy
from ._strategy import StrategyExtended as StrategyExtended
from ._strategy import get_strategy as get_strategy
from ._strategy import has_strategy as has_strategy
from ._values import DistributedValues as DistributedValues
from ._values import Mirrored as Mirrored
from ._values import PerReplica as PerReplica
from ._values import regroup as regroup
from ._values import select_replica as select_replica
from ._values import select_replica_mirrored as select_replica_mirrored
from ._variables import MirroredVariable as MirroredVariable
from ._variables import SyncOnReadVariable as SyncOnReadVariable
from ._variables import Variable as Variable
from ._variables import VariableAggregation as VariableAggregation
from ._variables import VariableSynchronization as VariableSynchronization

__version__ = "0.1.0"

__all__ = [
    "AioreplicaInternalError",
    "BatchedIterator",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "Cluster",
    "ClusterBroken",
    "ClusterSpec",
    "CommunicationImplementation",
    "CommunicationOptions",
    "Device",
    "DistributedDataset",
    "DistributedIterator",
    "DistributedValues",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Mirrored",
    "MirroredStrategy",
    "MirroredVariable",
    "MultiStepContext",
    "MultiWorkerMirroredStrategy",
    "OptionalValue",
    "PerReplica",
    "ReduceOp",
    "ReplicaContext",
    "ReplicaSyncError",
    "RestoreReport",
    "SchedulerStatistics",
    "StrategyExtended",
    "SyncOnReadVariable",
    "ValueContext",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "WorkersDisagree",
    "batched",
    "compute_average_loss",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "latest_checkpoint",
    "list_devices",
    "nest",
    "optimizers",
    "regroup",
    "scale_regularization_loss",
    "select_replica",
    "select_replica_mirrored",
]


def _fixup_module_metadata() -> None:
    """Show the public path (``aioreplica.PerReplica``) in reprs, tracebacks and pickles."""
    for name in __all__:
        obj = globals()[name]
        if getattr(obj, "__module__", "").startswith("aioreplica.") and name not in (
            "nest",
            "optimizers",
        ):
            with contextlib.suppress(AttributeError, TypeError):  # read-only on some objects
                obj.__module__ = __name__


_fixup_module_metadata()
del _fixup_module_metadata
