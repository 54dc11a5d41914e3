"""The loop adapters: one per running loop, chosen once; gates wake in the order asked."""

from __future__ import annotations

import asyncio
import types
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import sniffio

from aioreplica import MirroredStrategy
from aioreplica._loops import current
from aioreplica.testing import host_devices, replica_context

if TYPE_CHECKING:
    from collections.abc import Generator

pytestmark = pytest.mark.anyio


class TestCurrent:
    async def test_one_adapter_per_loop(self) -> None:
        """Every call on one loop, in a replica and in device work alike, gets one adapter."""
        strategy = MirroredStrategy(host_devices(2))
        seen = [current()]

        async def step() -> None:
            seen.append(current())
            await replica_context().device.run(lambda: None)  # device.run takes the adapter too
            seen.append(current())

        await strategy.run(step)
        assert all(adapter is seen[0] for adapter in seen)
        module = type(seen[0]).__module__
        assert module == f"aioreplica._loops._{sniffio.current_async_library()}"

    def test_each_asyncio_loop_gets_its_own(self) -> None:
        """Two asyncio loops, one after the other, get different adapters."""

        async def adapter() -> object:
            return current()

        first = asyncio.run(adapter())
        second = asyncio.run(adapter())
        assert first is not second

    def test_outside_a_loop(self) -> None:
        """No running loop: a RuntimeError that says how to run one."""
        with pytest.raises(RuntimeError, match=r"anyio.run\(main\) or asyncio.run\(main\(\)\)"):
            current()


class TestGates:
    @pytest.mark.parametrize("ordered", [True, False])
    async def test_open_wakes_in_the_order_asked(self, ordered: bool) -> None:
        """Parked tasks resume in the order open() names them (trio: any order, all woken);
        a slot that never parked is skipped."""
        gate = current().gate_factory(ordered=ordered)()
        woken: list[int] = []

        @types.coroutine
        def wait(slot: int) -> Generator[Any, Any, None]:
            yield from gate.park(slot)

        async def park(slot: int) -> None:
            await wait(slot)
            woken.append(slot)

        async with anyio.create_task_group() as group:
            for slot in (2, 0, 1):
                group.start_soon(park, slot)
            await anyio.wait_all_tasks_blocked()
            assert woken == []
            gate.open([2, 0, 5, 1] if ordered else [1, 2, 0])
        assert gate.opened
        if sniffio.current_async_library() == "trio":
            assert sorted(woken) == [0, 1, 2]
        else:
            assert woken == ([2, 0, 1] if ordered else [1, 2, 0])


class TestCancelled:
    """``cancelled()``: whether ``anyio.lowlevel.checkpoint_if_cancelled()`` may raise here, the
    cheap check before it that ``run()`` makes at its start (on trio, always True)."""

    async def test_outside_any_cancelled_scope(self) -> None:
        trio = sniffio.current_async_library() == "trio"
        seen = [current().cancelled()]
        with anyio.CancelScope():  # noqa: ASYNC100 - asked inside, no wait needed
            seen.append(current().cancelled())
        assert seen == [trio, trio]

    async def test_in_a_cancelled_scope_and_behind_a_shield(self) -> None:
        """A cancelled scope around the task counts, at any depth; a shield inside it keeps
        it out, as it keeps it out of the checkpoint."""
        trio = sniffio.current_async_library() == "trio"
        seen: list[tuple[str, bool]] = []
        with anyio.CancelScope() as outer:
            outer.cancel()
            with anyio.CancelScope():
                seen.append(("nested", current().cancelled()))
                with anyio.CancelScope(shield=True):
                    seen.append(("shielded", current().cancelled()))
                    await anyio.lowlevel.checkpoint_if_cancelled()  # does not raise
                    seen.append(("passed the shield's checkpoint", True))
                with pytest.raises(anyio.get_cancelled_exc_class()):
                    await anyio.lowlevel.checkpoint_if_cancelled()
        assert seen == [
            ("nested", True),
            ("shielded", trio),
            ("passed the shield's checkpoint", True),
        ]
