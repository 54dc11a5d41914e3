"""``cupy.cuda.nccl``: communicators of several GPUs in one process, as ``initAll`` makes them.

With ``CUPY_SIM_NCCL=0`` NCCL is missing: importing warns, and the module has ``available =
False`` and nothing else, as CuPy's stub when its wheel cannot load the library
(``cupy/cuda/nccl.py``).

A call names its buffers by address and its stream by handle, as the real API does. Each
communicator's calls are matched, in order, with the other ranks' calls; a call runs when
every rank has made it: one thread driving several GPUs must put their calls inside
``groupStart()``/``groupEnd()`` (a lone call would wait forever for the other ranks, which is
a ``SimulationError`` here), and ``groupEnd`` with a call some rank never made is one too.
Buffers must be live device memory on the communicator's GPU with room for ``count``
elements; the stream must belong to that GPU. The kernels of one collective wait for each
other, so their streams' clocks are joined.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np

from .. import _sim

NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9

NCCL_SUM = 0
NCCL_PROD = 1
NCCL_MAX = 2
NCCL_MIN = 3
NCCL_AVG = 4

_DTYPES = {
    NCCL_INT8: np.int8,
    NCCL_UINT8: np.uint8,
    NCCL_INT32: np.int32,
    NCCL_UINT32: np.uint32,
    NCCL_INT64: np.int64,
    NCCL_UINT64: np.uint64,
    NCCL_FLOAT16: np.float16,
    NCCL_FLOAT32: np.float32,
    NCCL_FLOAT64: np.float64,
}
_OPS = {NCCL_SUM: np.add, NCCL_PROD: np.multiply, NCCL_MAX: np.maximum, NCCL_MIN: np.minimum}

available = os.environ.get("CUPY_SIM_NCCL", "1") != "0"
if not available:
    warnings.warn(
        "NCCL library could not be loaded (cupy_sim: CUPY_SIM_NCCL=0)", UserWarning, stacklevel=2
    )


class NcclError(RuntimeError):
    pass


def get_version() -> int:
    return 22000


def get_build_version() -> int:
    return 22000


class _Clique:
    def __init__(self, devices: list[int]) -> None:
        self.devices = devices
        self.pending: list[list[tuple[Any, ...]]] = [[] for _ in devices]


_group_depth = 0
_touched: list[_Clique] = []


def groupStart() -> None:
    global _group_depth
    _require()
    _group_depth += 1


def groupEnd() -> None:
    global _group_depth
    _require()
    if _group_depth == 0:
        raise NcclError("ncclGroupEnd without ncclGroupStart")
    _group_depth -= 1
    if _group_depth == 0:
        cliques = list(dict.fromkeys(_touched))
        _touched.clear()
        for clique in cliques:
            _run_ready(clique)
            stuck = [rank for rank, calls in enumerate(clique.pending) if calls]
            if stuck:
                for calls in clique.pending:
                    calls.clear()
                raise _sim.SimulationError(
                    f"NCCL would hang: ranks {stuck} made calls that the other ranks of the "
                    f"communicator on GPUs {clique.devices} never matched ({_sim.caller()})"
                )


def _require() -> None:
    if not available:
        raise RuntimeError("NCCL is not available")


class NcclCommunicator:
    """One rank of a clique made by ``initAll`` (the multi-process constructor is not here)."""

    def __init__(self, ndev: int, commId: Any, rank: int) -> None:
        raise NotImplementedError("cupy_sim: only NcclCommunicator.initAll")

    @staticmethod
    def initAll(devices: Any) -> list[NcclCommunicator]:
        _require()
        world = _sim.world()
        if isinstance(devices, int):
            devices = list(range(devices))
        elif isinstance(devices, list):
            devices = [int(d) for d in devices]
        else:
            raise ValueError('"devices" should be an int or a list of int.')
        for device in devices:
            world.check_device(device)
        if len(set(devices)) != len(devices):
            raise NcclError(f"ncclCommInitAll: a GPU appears twice in {devices}")
        clique = _Clique(devices)
        communicators = []
        for rank, device in enumerate(devices):
            comm = object.__new__(NcclCommunicator)
            comm._clique = clique
            comm._rank = rank
            comm._device = device
            communicators.append(comm)
        return communicators

    _clique: _Clique
    _rank: int
    _device: int

    def rank_id(self) -> int:
        return self._rank

    def device_id(self) -> int:
        return self._device

    def size(self) -> int:
        return len(self._clique.devices)

    def destroy(self) -> None:
        pass

    def allReduce(
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int
    ) -> None:
        self._post(("allReduce", count, datatype, op), sendbuf, recvbuf, stream)

    def broadcast(
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, root: int, stream: int
    ) -> None:
        self._post(("broadcast", count, datatype, root), sendbuf, recvbuf, stream)

    def reduceScatter(
        self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int
    ) -> None:
        self._post(("reduceScatter", recvcount, datatype, op), sendbuf, recvbuf, stream)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:
        self._post(("allGather", count, datatype, None), sendbuf, recvbuf, stream)

    def _post(self, call: tuple[Any, ...], sendbuf: int, recvbuf: int, stream: int) -> None:
        _require()
        clique = self._clique
        clique.pending[self._rank].append((*call, sendbuf, recvbuf, stream, _sim.caller()))
        if _group_depth:
            _touched.append(clique)
            return
        _run_ready(clique)
        if any(clique.pending):
            for calls in clique.pending:
                calls.clear()
            raise _sim.SimulationError(
                f"NCCL would hang: a {call[0]} call on GPU {self._device} outside "
                "groupStart()/groupEnd() waits for the other ranks, which this thread drives "
                f"({_sim.caller()})"
            )


def _agent_of(handle: int, device: int) -> _sim.Agent:
    world = _sim.world()
    if handle == 0:
        return world.null[device]
    agent = world.handles.get(handle)
    if agent is None:
        raise _sim.SimulationError(f"NCCL call on an unknown stream handle {handle:#x}")
    if agent.device != device:
        raise _sim.SimulationError(f"NCCL call for GPU {device} on a stream of GPU {agent.device}")
    return agent


def _run_ready(clique: _Clique) -> None:
    while all(clique.pending):
        calls = [pending.pop(0) for pending in clique.pending]
        _run(clique, calls)


def _run(clique: _Clique, calls: list[tuple[Any, ...]]) -> None:
    world = _sim.world()
    kind, count, datatype, extra = calls[0][:4]
    for rank, call in enumerate(calls):
        if call[:4] != (kind, count, datatype, extra):
            raise _sim.SimulationError(
                f"NCCL calls do not match: rank 0 made {calls[0][:4]} at {calls[0][-1]}, rank "
                f"{rank} made {call[:4]} at {call[-1]}"
            )
    dtype = np.dtype(_DTYPES[datatype])
    size = len(calls)
    send_count = count * size if kind == "reduceScatter" else count
    recv_count = count * size if kind == "allGather" else count
    with world.lock:
        agents, sends, recvs = [], [], []
        for rank, (*_, sendbuf, recvbuf, stream, _where) in enumerate(calls):
            device = clique.devices[rank]
            agent = _agent_of(stream, device)
            tick = world.launch(agent)
            agents.append(agent)
            what = f"NCCL {kind} rank {rank}"
            needs_send = kind != "broadcast" or rank == extra
            send = None
            if needs_send and count:
                send = _buffer(world, sendbuf, send_count, dtype, device, what)
                world.access(send[0], agent, tick, False, what)
            recv = _buffer(world, recvbuf, recv_count, dtype, device, what) if count else None
            sends.append(send)
            recvs.append(recv)
        if count:
            if kind == "allReduce":
                parts = [send[1].copy() for send in sends if send is not None]
                if extra == NCCL_AVG:
                    result = np.add.reduce(parts) / size
                else:
                    result = _OPS[extra].reduce(parts)
                results = [result] * size
            elif kind == "broadcast":
                source = sends[extra]
                assert source is not None
                results = [source[1].copy()] * size
            elif kind == "reduceScatter":
                whole = _OPS[extra].reduce([send[1].copy() for send in sends if send is not None])
                results = [whole[r * count : (r + 1) * count] for r in range(size)]
            else:  # allGather
                whole = np.concatenate([send[1].copy() for send in sends if send is not None])
                results = [whole] * size
            for rank, recv in enumerate(recvs):
                assert recv is not None
                world.access(
                    recv[0],
                    agents[rank],
                    agents[rank].clock[agents[rank].id],
                    True,
                    f"NCCL {kind} rank {rank}",
                )
                recv[1][...] = results[rank].astype(dtype, copy=False)
        joined = _sim.Clock()
        for agent in agents:
            joined.join(agent.clock)
        for agent in agents:
            agent.clock.join(joined)
            agent.tick()


def _buffer(
    world: _sim.World, ptr: int, count: int, dtype: np.dtype[Any], device: int, what: str
) -> tuple[_sim.Block, np.ndarray[Any, Any]]:
    nbytes = count * dtype.itemsize
    block = world.block_at(ptr, nbytes, what)
    if block.device != device:
        raise _sim.SimulationError(
            f"{what}: buffer {ptr:#x} is on GPU {block.device}, the communicator's GPU is {device}"
        )
    offset = ptr - block.ptr
    return block, block.buffer[offset : offset + nbytes].view(dtype)


if not available:
    # CuPy's stub module has only ``available`` when the library is missing.
    for _name in [name for name in dir() if name.startswith("NCCL_")] + [
        "NcclCommunicator",
        "NcclError",
        "get_build_version",
        "get_version",
        "groupEnd",
        "groupStart",
    ]:
        del globals()[_name]
