"""The host backend's collectives, called directly: what the engine hands them, they return."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from aioreplica._backends._numpy import HOST_BACKEND, host_device

pytestmark = pytest.mark.anyio

UFUNCS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def leaves_for(replicas: int, dtype: Any) -> list[list[np.ndarray[Any, Any]]]:
    """Four leaves per replica: a matrix, a transposed (non-contiguous) one, a 0-d array and a
    vector, with values that differ between replicas."""
    rng = np.random.default_rng(replicas)

    def draw(shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
        return (rng.integers(1, 4, shape)).astype(dtype)

    return [
        [draw((3, 4)) for _ in range(replicas)],
        [draw((5, 2)).T for _ in range(replicas)],
        [draw(()) for _ in range(replicas)],
        [draw((7,)) for _ in range(replicas)],
    ]


class TestAllReducePacked:
    @pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "mean"])
    @pytest.mark.parametrize("replicas", [1, 2, 4])
    async def test_each_leaf_in_its_part_of_one_shared_output(self, op: str, replicas: int) -> None:
        """The flat result holds every leaf reduced as ``all_reduce`` reduces it alone, end
        to end in order; every replica gets the same read-only array."""
        devices = [host_device(i) for i in range(replicas)]
        leaves = leaves_for(replicas, np.float64)
        results = await HOST_BACKEND.all_reduce_packed(op, leaves, devices)
        assert len(results) == replicas
        assert all(result is results[0] for result in results)
        flat = results[0]
        assert not flat.flags.writeable
        expected = []
        for leaf in leaves:
            alone = await HOST_BACKEND.all_reduce(op, leaf, devices)
            expected.append(np.asarray(alone[0]).reshape(-1))
        np.testing.assert_array_equal(flat, np.concatenate(expected))
        if op != "mean":
            by_hand = [functools.reduce(UFUNCS[op], leaf).reshape(-1) for leaf in leaves]
            np.testing.assert_array_equal(flat, np.concatenate(by_hand))

    async def test_integers_keep_their_dtype(self) -> None:
        """Integer leaves sum as integers, in the leaves' dtype."""
        devices = [host_device(i) for i in range(3)]
        leaves = leaves_for(3, np.int32)
        flat = (await HOST_BACKEND.all_reduce_packed("sum", leaves, devices))[0]
        assert flat.dtype == np.int32
        by_hand = [functools.reduce(np.add, leaf).reshape(-1) for leaf in leaves]
        np.testing.assert_array_equal(flat, np.concatenate(by_hand))

    async def test_inputs_are_not_written(self) -> None:
        """The inputs come back unchanged: the output is a buffer of its own."""
        devices = [host_device(i) for i in range(2)]
        leaves = leaves_for(2, np.float32)
        before = [[x.copy() for x in leaf] for leaf in leaves]
        await HOST_BACKEND.all_reduce_packed("sum", leaves, devices)
        for leaf, kept in zip(leaves, before, strict=True):
            for x, y in zip(leaf, kept, strict=True):
                np.testing.assert_array_equal(x, y)


class TestAllReduce:
    @pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "mean"])
    async def test_small_inputs_in_any_layout(self, op: str) -> None:
        """Below INLINE_BYTES the inputs are reduced as they are, transposed ones too, into
        one shared read-only result of their shape."""
        devices = [host_device(i) for i in range(3)]
        inputs = leaves_for(3, np.float64)[1]  # (2, 5) views of (5, 2) arrays: not contiguous
        assert not inputs[0].flags.c_contiguous
        results = await HOST_BACKEND.all_reduce(op, inputs, devices)
        assert all(result is results[0] for result in results)
        assert not results[0].flags.writeable
        if op == "mean":
            expected = functools.reduce(np.add, inputs) / 3
        else:
            expected = functools.reduce(UFUNCS[op], inputs)
        np.testing.assert_array_equal(results[0], expected)
        assert results[0].shape == (2, 5)


class TestToHost:
    @pytest.mark.parametrize("shape", [(3, 4), (2048, 1024)], ids=["small", "8 MiB"])
    async def test_a_new_contiguous_copy_made_where_the_device_computes(
        self, shape: tuple[int, ...]
    ) -> None:
        """The copy goes through ``device.compute`` with its size (inline when small, on the
        device's worker when large), and is a new, writeable, C-contiguous array."""
        device = host_device(0)
        sizes: list[int] = []

        class Watched:
            backend = HOST_BACKEND

            async def compute(self, nbytes: int, fn: Any, *args: Any) -> Any:
                sizes.append(nbytes)
                return await device.compute(nbytes, fn, *args)

        value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape[::-1]).T
        value.flags.writeable = False
        got = await HOST_BACKEND.to_host(value, Watched())  # type: ignore[arg-type]
        assert sizes == [value.nbytes]
        np.testing.assert_array_equal(got, value)
        assert got.flags.c_contiguous
        assert got.flags.writeable
        assert not np.shares_memory(got, value)
