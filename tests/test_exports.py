"""Tests for the public surface: ``aioreplica.__all__``, ``aioreplica.nest``, metadata, imports."""

from __future__ import annotations

import importlib.resources
import inspect
import json
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

import aioreplica
from aioreplica import _tree, nest, optimizers

if TYPE_CHECKING:
    import types
    from collections.abc import Callable


def _public(module: types.ModuleType) -> list[tuple[str, Any]]:
    return [(name, getattr(module, name)) for name in module.__all__]


def _is_class_or_function(obj: object) -> bool:
    return isinstance(obj, type) or inspect.isfunction(obj)


def _public_functions() -> list[tuple[str, Callable[..., Any]]]:
    """Top-level and ``nest`` functions, and the methods of the public classes."""
    found: list[tuple[str, Callable[..., Any]]] = []
    for module in (aioreplica, nest):
        prefix = "" if module is aioreplica else "nest."
        found += [(prefix + name, obj) for name, obj in _public(module) if inspect.isfunction(obj)]
    classes = [*_public(aioreplica), *((f"optimizers.{n}", c) for n, c in _public(optimizers))]
    for name, obj in classes:
        if not isinstance(obj, type) or obj is aioreplica.Device:
            continue
        for attr, value in vars(obj).items():
            if not attr.startswith("_") and inspect.isfunction(value):
                found.append((f"{name}.{attr}", value))
    return found


PUBLIC_FUNCTIONS = _public_functions()

#: Public functions that raise on misuse, so their docstrings must say when.
RAISING = [
    "regroup",
    "select_replica",
    "select_replica_mirrored",
    "MirroredStrategy.run",
    "MirroredStrategy.scope",
    "ReplicaContext.merge_call",
    "StrategyExtended.update",
    "Variable.value",
    "Variable.assign",
    "Variable.assign_add",
    "Variable.assign_sub",
    "Checkpoint.save",
    "Checkpoint.restore",
    "CheckpointManager.save",
    "optimizers.Optimizer.apply_gradients",
    "optimizers.Optimizer.build",
    "optimizers.Optimizer.get_slot",
    "nest.assert_same_structure",
    "nest.assert_shallow_structure",
    "nest.flatten",
    "nest.flatten_up_to",
    "nest.flatten_with_joined_string_paths",
    "nest.flatten_with_key_paths",
    "nest.flatten_with_treedef",
    "nest.flatten_with_tuple_paths",
    "nest.map_structure",
    "nest.map_structure_up_to",
    "nest.map_structure_with_paths",
    "nest.map_structure_with_tuple_paths",
    "nest.pack_sequence_as",
    "nest.register_dataclass",
    "nest.register_node",
    "nest.unflatten",
]

FINAL = [
    "BatchedIterator",
    "Checkpoint",
    "CheckpointManager",
    "Mirrored",
    "MirroredVariable",
    "PerReplica",
    "ReplicaContext",
    "RestoreReport",
    "StrategyExtended",
    "SyncOnReadVariable",
]

NOT_IMPORTED = ["cupy", "trio", "mpi4py", "uvloop"]


class TestAll:
    def test_every_name_exists(self) -> None:
        """Every name in ``__all__`` is an attribute of the package."""
        assert [name for name in aioreplica.__all__ if not hasattr(aioreplica, name)] == []

    def test_sorted_without_duplicates(self) -> None:
        """``__all__`` is sorted and names each object once."""
        assert aioreplica.__all__ == sorted(set(aioreplica.__all__))

    def test_public_objects_show_the_public_module(self) -> None:
        """Every public class and function reports ``__module__ == "aioreplica"``."""
        wrong = {
            name: obj.__module__
            for name, obj in _public(aioreplica)
            if _is_class_or_function(obj) and obj.__module__ != "aioreplica"
        }
        assert wrong == {}

    def test_every_public_object_is_a_class_function_or_module(self) -> None:
        """Besides classes and functions, only the ``nest`` and ``optimizers`` modules are."""
        others = [name for name, obj in _public(aioreplica) if not _is_class_or_function(obj)]
        assert others == ["nest", "optimizers"]
        assert aioreplica.nest is nest
        assert aioreplica.optimizers is optimizers

    @pytest.mark.parametrize("name", FINAL)
    def test_class_is_final(self, name: str) -> None:
        """Classes not built for subclassing are marked ``typing.final``."""
        assert getattr(getattr(aioreplica, name), "__final__", False) is True

    def test_distributed_values_is_open_for_subclassing(self) -> None:
        """``DistributedValues`` is the base of ``PerReplica`` and ``Mirrored``, not final."""
        assert getattr(aioreplica.DistributedValues, "__final__", False) is False
        assert issubclass(aioreplica.PerReplica, aioreplica.DistributedValues)
        assert issubclass(aioreplica.Mirrored, aioreplica.DistributedValues)

    def test_errors_subclass_runtime_error(self) -> None:
        """The library's exceptions subclass the nearest builtin."""
        assert issubclass(aioreplica.ReplicaSyncError, RuntimeError)
        assert issubclass(aioreplica.AioreplicaInternalError, RuntimeError)
        assert issubclass(aioreplica.CheckpointError, ValueError)
        assert issubclass(aioreplica.WorkersDisagree, ValueError)
        assert issubclass(aioreplica.ClusterBroken, RuntimeError)

    def test_variable_classes(self) -> None:
        """``Variable`` is the base of the distributed variables, open for them only."""
        assert issubclass(aioreplica.MirroredVariable, aioreplica.Variable)
        assert issubclass(aioreplica.SyncOnReadVariable, aioreplica.Variable)
        assert getattr(aioreplica.Variable, "__final__", False) is False

    def test_version_is_a_string(self) -> None:
        """``__version__`` is a dotted version string."""
        assert isinstance(aioreplica.__version__, str)
        assert all(part.isdigit() for part in aioreplica.__version__.split(".")[:2])


class TestNest:
    def test_every_name_exists(self) -> None:
        """Every name in ``nest.__all__`` is an attribute of ``nest``."""
        assert [name for name in nest.__all__ if not hasattr(nest, name)] == []

    def test_sorted_without_duplicates(self) -> None:
        """``nest.__all__`` is sorted and names each object once."""
        assert nest.__all__ == sorted(set(nest.__all__))

    def test_shared_objects_come_from_tree(self) -> None:
        """Key classes, ``TreeDef``, ``format_path`` and ``is_leaf`` are ``aioreplica._tree``'s
        own objects, so a TreeDef or key path from one module works with the other."""
        shared = [name for name, obj in _public(nest) if obj is getattr(_tree, name, None)]
        assert shared == [
            "AttrKey",
            "KeyEntry",
            "KeyPath",
            "MappingKey",
            "SequenceKey",
            "TreeDef",
            "format_path",
            "is_leaf",
        ]

    def test_own_functions_report_nest(self) -> None:
        """The functions with tf.nest's (or the JAX-style) meaning are ``aioreplica.nest``'s."""
        modules = {
            name: obj.__module__
            for name, obj in _public(nest)
            if _is_class_or_function(obj) and obj is not getattr(_tree, name, None)
        }
        assert set(modules.values()) == {"aioreplica.nest"}
        assert "flatten" in modules


class TestOptimizers:
    def test_all_sorted_and_present(self) -> None:
        """``optimizers.__all__`` names the optimizer classes, in isort order."""
        assert optimizers.__all__ == [
            "SGD",
            "Adagrad",
            "Adam",
            "AdamW",
            "Optimizer",
            "RMSprop",
        ]  # isort order, as ruff keeps it

    def test_classes_show_the_public_module(self) -> None:
        """Each optimizer class reports ``aioreplica.optimizers`` as its module."""
        assert {obj.__module__ for _, obj in _public(optimizers)} == {"aioreplica.optimizers"}
        assert all(issubclass(obj, optimizers.Optimizer) for _, obj in _public(optimizers))


class TestDocstrings:
    @pytest.mark.parametrize(
        ("name", "function"), PUBLIC_FUNCTIONS, ids=[name for name, _ in PUBLIC_FUNCTIONS]
    )
    def test_has_an_example(self, name: str, function: Callable[..., Any]) -> None:
        """Every public function and method shows an example."""
        assert "Example" in (inspect.getdoc(function) or ""), name

    @pytest.mark.parametrize("name", RAISING)
    def test_documents_what_it_raises(self, name: str) -> None:
        """Public functions that raise have a Raises section."""
        function = dict(PUBLIC_FUNCTIONS)[name]
        assert "Raises" in (inspect.getdoc(function) or "")

    def test_found_the_public_functions(self) -> None:
        """The docstring checks cover the top-level functions and the key methods."""
        names = {name for name, _ in PUBLIC_FUNCTIONS}
        expected = {
            "get_replica_context",
            "get_strategy",
            "has_strategy",
            "in_cross_replica_context",
            "list_devices",
            "MirroredStrategy.statistics",
            *RAISING,
        }
        assert expected - names == set()


class TestPackaging:
    def test_py_typed_is_shipped(self) -> None:
        """The package ships ``py.typed`` so type checkers use its annotations."""
        assert importlib.resources.files("aioreplica").joinpath("py.typed").is_file()

    def test_import_loads_no_optional_dependency(self) -> None:
        """``import aioreplica`` imports none of cupy, trio, mpi4py or uvloop."""
        code = (
            "import json, sys\n"
            "import aioreplica\n"
            f"banned = {NOT_IMPORTED!r}\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in banned)))\n"
        )
        completed = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=20
        )
        assert (completed.returncode, completed.stderr) == (0, "")
        assert json.loads(completed.stdout) == []
