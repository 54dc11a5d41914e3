"""Flatten, rebuild, map over and compare nested structures.

``aioreplica`` walks lists, tuples, namedtuples, mappings and registered types the same way
everywhere: in ``regroup``, in merge arguments, in dataset batches and in checkpoints. The
functions here expose that walk. ``None`` is a leaf; mapping keys are matched as sets and
leaves come out in sorted-key order. See ``help(aioreplica._tree)`` for every rule.
"""

from ._tree import AttrKey as AttrKey
from ._tree import KeyEntry as KeyEntry
from ._tree import KeyPath as KeyPath
from ._tree import MappingKey as MappingKey
from ._tree import SequenceKey as SequenceKey
from ._tree import TreeDef as TreeDef
from ._tree import assert_same_structure as assert_same_structure
from ._tree import flatten as flatten
from ._tree import flatten_with_path as flatten_with_path
from ._tree import format_path as format_path
from ._tree import is_leaf as is_leaf
from ._tree import map_structure as map_structure
from ._tree import map_structure_with_path as map_structure_with_path
from ._tree import register_dataclass as register_dataclass
from ._tree import register_node as register_node
from ._tree import unflatten as unflatten

__all__ = [
    "AttrKey",
    "KeyEntry",
    "KeyPath",
    "MappingKey",
    "SequenceKey",
    "TreeDef",
    "assert_same_structure",
    "flatten",
    "flatten_with_path",
    "format_path",
    "is_leaf",
    "map_structure",
    "map_structure_with_path",
    "register_dataclass",
    "register_node",
    "unflatten",
]
