"""A CPU stand-in for the parts of CuPy that aioreplica and its GPU checks use.

Put ``tests/cupy_sim`` first on ``sys.path`` (or ``PYTHONPATH``) and ``import cupy`` gives this
package: arrays live in host memory, every kernel runs at once on NumPy, and a happens-before
race detector (``cupy._sim``) fails any access to device memory that CUDA would not order.
``CUPY_SIM_DEVICES`` sets how many GPUs it has (default 2), ``CUPY_SIM_NCCL=0`` makes NCCL
missing, as on a CuPy wheel without it.

What it models, each as CuPy 13.6 and 14.x do (see ``tests/cupy_sim/README.md`` for the
sources): a current device per thread and a current stream per device and thread; blocking and
non-blocking streams and the legacy default stream; events; stream callbacks on a driver
thread; a memory pool with one arena per stream; arrays that carry their device and a real
address; kernels that run on the current device's current stream, reading arrays on another
device only with peer access; ``get()``/``asnumpy`` as a copy on the current stream followed by
a host wait; ``asarray`` of host data as a copy on the current stream; NCCL communicators in
one process, group calls, bounds-checked counts.
"""

from __future__ import annotations

import operator
import types
import warnings
from typing import Any

import numpy as _np

from . import _sim, cuda  # noqa: F401 - cupy.cuda is part of the API
from .cuda import Device as _Device
from .cuda import MemoryPointer as _MemoryPointer
from .cuda import get_current_stream as _get_current_stream

__version__ = "14.0.0+sim"

#: Functions that allocate their result without writing it.
_UNWRITTEN = frozenset({"empty", "empty_like"})
#: Functions that read only the shape and dtype of their array argument, not its data.
_SHAPE_ONLY = frozenset({"empty_like", "zeros_like", "ones_like", "full_like"})


# -- launching kernels ------------------------------------------------------------------------


def _unwrap(value: Any, arrays: list[ndarray]) -> Any:
    if isinstance(value, ndarray):
        arrays.append(value)
        return value._a
    if isinstance(value, _np.ndarray) and value.ndim:
        raise TypeError(f"Unsupported type {type(value)}")
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(item, arrays) for item in value)
    return value


class _util:
    class PerformanceWarning(RuntimeWarning):
        """Warns about code that runs slowly (``cupy/_util.pyx``)."""


def _check_device(array: ndarray, device: int, world: _sim.World) -> None:
    """``_check_peer_access`` (``cupy/_core/_kernel.pyx``): a kernel may read an array on
    another GPU only through peer access, which CuPy turns on with a ``PerformanceWarning``."""
    where = array._lease.block.device
    if where == device:
        return
    message = (
        f"The device where the array resides ({where}) is different from the current "
        f"device ({device})."
    )
    if not world.peer_access:
        raise ValueError(f"{message} Peer access is unavailable between these devices.")
    warnings.warn(
        f"{message} Peer access has been activated automatically.",
        _util.PerformanceWarning,
        stacklevel=4,
    )


def _call(
    what: str,
    fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    writes: tuple[ndarray, ...] = (),
    only_writes: bool = False,
    device: int | None = None,
) -> Any:
    """Run ``fn`` on NumPy as a kernel on the current stream: check, compute, record, wrap.

    ``writes`` are arrays among the arguments that the kernel writes in place (besides
    ``out=``); with ``only_writes`` it does not read them first (``fill``, ``x[k] = v``).
    """
    world = _sim.world()
    if device is None:
        device = world.thread.device
    stream = _get_current_stream(device)
    inputs: list[ndarray] = []
    outputs: list[ndarray] = list(writes)
    plain_args = _unwrap(args, inputs)
    if only_writes:
        inputs = [array for array in inputs if not any(array is w for w in writes)]
    plain_kwargs = {}
    for key, value in kwargs.items():
        if key == "out" and value is not None:
            outs = value if isinstance(value, tuple) else (value,)
            if not all(isinstance(out, ndarray) for out in outs):
                raise TypeError(f"out must be a cupy.ndarray, got {type(value)}")
            outputs.extend(outs)
            plain_kwargs[key] = _unwrap(value, [])
        else:
            plain_kwargs[key] = _unwrap(value, inputs)
    with world.lock:
        result = fn(*plain_args, **plain_kwargs)
        agent = stream.agent
        made: list[ndarray] = []
        wrapped = _wrap_result(result, [*inputs, *outputs], device, agent, made)
        if not outputs and not made:
            return wrapped  # a view, or the argument itself: no kernel
        for array in (*inputs, *outputs):
            _check_device(array, device, world)
        tick = world.launch(agent)
        if what not in _UNWRITTEN:
            world.kernels.append((what, agent.name))
        seen: set[int] = set()
        for array in () if what in _SHAPE_ONLY else inputs:
            block = array._lease.block
            if block.ptr not in seen:
                seen.add(block.ptr)
                world.access(block, agent, tick, False, what)
        written: set[int] = set()
        for array in (*outputs, *([] if what in _UNWRITTEN else made)):
            block = array._lease.block
            if block.ptr not in written:
                written.add(block.ptr)
                world.access(block, agent, tick, True, what)
        return wrapped


def _wrap_result(
    result: Any, sources: list[ndarray], device: int, agent: _sim.Agent, made: list[ndarray]
) -> Any:
    """``result`` as device arrays: views of ``sources`` where it shares their memory, else
    fresh allocations (appended to ``made``)."""
    if isinstance(result, tuple):
        return tuple(_wrap_result(r, sources, device, agent, made) for r in result)
    if isinstance(result, list) and result and isinstance(result[0], _np.ndarray):
        return [_wrap_result(r, sources, device, agent, made) for r in result]
    if isinstance(result, _np.generic):
        result = _np.asarray(result)
    if not isinstance(result, _np.ndarray):
        return result
    for source in sources:
        if result is source._a:
            return source
    address = result.__array_interface__["data"][0]
    for source in sources:
        block = source._lease.block
        if result.size == 0:
            # An empty view shares no bytes with anything (``np.shares_memory`` says no), but
            # CuPy's is still a view on its source's GPU (``_view_getitem``): no kernel.
            if _viewed_from(result, block.buffer):
                return ndarray._view(source._lease, result)
        elif block.ptr <= address < block.ptr + block.size and _np.shares_memory(
            result, block.buffer
        ):
            return ndarray._view(source._lease, result)
    array = _allocate(result.shape, result.dtype, device, agent, f_order=_f_only(result))
    array._a[...] = result
    made.append(array)
    return array


def _viewed_from(array: _np.ndarray[Any, Any], buffer: _np.ndarray[Any, Any]) -> bool:
    """Whether ``array`` is a view whose chain of bases reaches ``buffer``."""
    base = array.base
    while base is not None:
        if base is buffer:
            return True
        base = getattr(base, "base", None)
    return False


def _f_only(array: _np.ndarray[Any, Any]) -> bool:
    return bool(array.flags.f_contiguous and not array.flags.c_contiguous)


def _allocate(
    shape: tuple[int, ...], dtype: Any, device: int, agent: _sim.Agent, *, f_order: bool = False
) -> ndarray:
    dtype = _np.dtype(dtype)
    count = 1
    for extent in shape:
        count *= extent
    lease = _sim.world().allocate(device, count * dtype.itemsize, agent)
    view = _np.ndarray(
        shape, dtype, buffer=lease.block.buffer, offset=0, order="F" if f_order else "C"
    )
    return ndarray._view(lease, view)


def _host_to_device(value: Any, dtype: Any = None, order: Any = None) -> ndarray:
    """A copy of host data on the current device, written on its current stream."""
    host = _np.asarray(value, dtype=dtype, order=order)
    if host.dtype.kind in "OUSV":
        raise ValueError(f"Unsupported dtype {host.dtype}")
    world = _sim.world()
    device = world.thread.device
    with world.lock:
        agent = _get_current_stream(device).agent
        tick = world.launch(agent)
        array = _allocate(host.shape, host.dtype, device, agent, f_order=_f_only(host))
        array._a[...] = host
        world.access(array._lease.block, agent, tick, True, "host-to-device copy")
    return array


# -- arrays -----------------------------------------------------------------------------------


class ndarray:
    """A device array: a NumPy view into one block of simulated device memory."""

    __slots__ = ("__weakref__", "_a", "_lease")

    _a: _np.ndarray[Any, Any]
    _lease: _sim.Lease

    def __init__(
        self,
        shape: Any,
        dtype: Any = float,
        memptr: Any = None,
        strides: Any = None,
        order: str = "C",
    ) -> None:
        if memptr is not None or strides is not None:
            raise NotImplementedError("cupy_sim: ndarray(memptr=, strides=)")
        world = _sim.world()
        device = world.thread.device
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        made = _allocate(shape, dtype, device, _get_current_stream(device).agent)
        self._a = made._a
        self._lease = made._lease

    @classmethod
    def _view(cls, lease: _sim.Lease, view: _np.ndarray[Any, Any]) -> ndarray:
        self = object.__new__(cls)
        self._a = view
        self._lease = lease
        return self

    # attributes that need no kernel
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)

    @property
    def device(self) -> _Device:
        return _Device(self._lease.block.device)

    @property
    def data(self) -> _MemoryPointer:
        return _MemoryPointer(self._lease.block.device, self._a.__array_interface__["data"][0])

    @property
    def T(self) -> ndarray:
        return ndarray._view(self._lease, self._a.T)

    @property
    def real(self) -> ndarray:
        if self._a.dtype.kind != "c":
            return self
        return ndarray._view(self._lease, self._a.real)

    @property
    def imag(self) -> ndarray:
        if self._a.dtype.kind != "c":
            return _call("imag", _np.zeros_like, (self,), {})  # type: ignore[no-any-return]
        return ndarray._view(self._lease, self._a.imag)

    # host transfers

    def get(
        self, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True
    ) -> _np.ndarray[Any, Any]:
        """A host copy, made on ``stream``, by default the current device's current stream,
        with the array's GPU made current (``_core/core.pyx``, ``get``): the default stream
        then means the array's GPU's default stream."""
        world = _sim.world()
        device = self._lease.block.device
        if stream is None:
            stream = _get_current_stream()
        if self.size == 0:
            return _np.ndarray(self.shape, dtype=self.dtype)
        world.declare_synchronize()
        with world.lock:
            agent = world.null[device] if stream.ptr == 0 else stream.agent
            tick = world.launch(agent)
            world.access(self._lease.block, agent, tick, False, "device-to-host copy (get)")
            host: _np.ndarray[Any, Any] = _np.array(self._a, order=order, copy=True)  # type: ignore[call-overload]
            clock = _sim.Clock(agent.clock)
        if blocking:
            world.host_sync(clock, "ndarray.get")
        if out is not None:
            out[...] = host
            return out  # type: ignore[no-any-return]
        return host

    def set(self, arr: Any, stream: Any = None) -> None:
        world = _sim.world()
        device = self._lease.block.device
        if stream is None:
            stream = _get_current_stream()
        with world.lock:
            agent = world.null[device] if stream.ptr == 0 else stream.agent
            tick = world.launch(agent)
            world.access(self._lease.block, agent, tick, True, "host-to-device copy (set)")
            self._a[...] = _np.asarray(arr)

    def item(self) -> Any:
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return self.get().item()

    def tolist(self) -> Any:
        return self.get().tolist()

    def __float__(self) -> float:
        return float(self.get())

    def __int__(self) -> int:
        return int(self.get())

    def __complex__(self) -> complex:
        return complex(self.get())

    def __bool__(self) -> bool:
        if self.size > 1:
            raise ValueError(
                "The truth value of an array with more than one element is ambiguous. Use "
                "a.any() or a.all()"
            )
        return bool(self.get()) if self.size else False

    def __index__(self) -> int:
        if self._a.dtype.kind not in "iub" or self._a.ndim:
            raise TypeError("only integer scalar arrays can be converted to a scalar index")
        return int(self.get())

    def __repr__(self) -> str:
        return repr(self.get()).replace("array", "array", 1)

    def __str__(self) -> str:
        return str(self.get())

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
            "construct a NumPy array explicitly."
        )

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Any:
        if self._a.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(len(self._a)))

    # kernels

    def __getitem__(self, key: Any) -> ndarray:
        return _call("getitem", operator.getitem, (self, key), {})  # type: ignore[no-any-return]

    def __setitem__(self, key: Any, value: Any) -> None:
        _call("setitem", operator.setitem, (self, key, value), {}, writes=(self,), only_writes=True)

    def copy(self, order: str = "C") -> ndarray:
        """On the current device; from another GPU (``core.pyx``, ``copy``): made contiguous
        on its own GPU's current stream, then copied on the current device's current stream,
        with nothing ordering the two."""
        world = _sim.world()
        here = world.thread.device
        source = self._lease.block.device
        if source == here:
            return _call("copy", _np.array, (self,), {"order": order, "copy": True})  # type: ignore[no-any-return]
        saved = world.thread.device
        world.thread.device = source
        try:
            contiguous = self.astype(self.dtype, order=order, copy=False)
        finally:
            world.thread.device = saved
        if not (contiguous.flags.c_contiguous or contiguous.flags.f_contiguous):
            raise NotImplementedError("CuPy cannot copy non-contiguous array between devices.")
        with world.lock:
            agent = _get_current_stream().agent
            tick = world.launch(agent)
            world.access(contiguous._lease.block, agent, tick, False, "copy between devices")
            array = _allocate(
                contiguous.shape, contiguous.dtype, here, agent, f_order=_f_only(contiguous._a)
            )
            array._a[...] = contiguous._a
            world.access(array._lease.block, agent, tick, True, "copy between devices")
        return array

    def astype(
        self,
        dtype: Any,
        order: str = "K",
        casting: Any = None,
        subok: Any = None,
        copy: bool = True,
    ) -> ndarray:
        kwargs: dict[str, Any] = {"order": order, "copy": copy}
        if casting is not None:
            kwargs["casting"] = casting
        return _call("astype", _np.ndarray.astype, (self, dtype), kwargs)  # type: ignore[no-any-return]

    def __copy__(self) -> ndarray:
        return self.copy()

    def __deepcopy__(self, memo: Any) -> ndarray:
        """On the array's own GPU (``core.pyx``, ``__deepcopy__``)."""
        thread = _sim.world().thread
        saved = thread.device
        thread.device = self._lease.block.device
        try:
            return self.copy()
        finally:
            thread.device = saved

    def fill(self, value: Any) -> None:
        _call("fill", _np.ndarray.fill, (self, value), {}, writes=(self,), only_writes=True)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if method != "__call__":
            return NotImplemented
        return _call(ufunc.__name__, ufunc, inputs, kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        ours = globals().get(func.__name__)
        if ours is None:
            return NotImplemented
        return ours(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(_np.ndarray, name, None)
        if attribute is None or name.startswith("_") or not callable(attribute):
            raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r}")
        writes = (self,) if name in ("sort", "partition", "put", "itemset", "setfield") else ()

        def method(*args: Any, **kwargs: Any) -> Any:
            return _call(f"ndarray.{name}", attribute, (self, *args), kwargs, writes=writes)

        return method


def _binary(name: str, ufunc: Any, *, reflected: bool = False, inplace: bool = False) -> Any:
    if inplace:

        def op(self: ndarray, other: Any) -> Any:
            return _call(name, ufunc, (self, other), {"out": self})

    elif reflected:

        def op(self: ndarray, other: Any) -> Any:
            return _call(name, ufunc, (other, self), {})

    else:

        def op(self: ndarray, other: Any) -> Any:
            if isinstance(other, _np.ndarray) and other.ndim:
                return NotImplemented
            return _call(name, ufunc, (self, other), {})

    op.__name__ = name
    return op


for _name, _ufunc in {
    "add": _np.add,
    "sub": _np.subtract,
    "mul": _np.multiply,
    "truediv": _np.true_divide,
    "floordiv": _np.floor_divide,
    "mod": _np.remainder,
    "pow": _np.power,
    "matmul": _np.matmul,
    "and": _np.bitwise_and,
    "or": _np.bitwise_or,
    "xor": _np.bitwise_xor,
    "lshift": _np.left_shift,
    "rshift": _np.right_shift,
}.items():
    setattr(ndarray, f"__{_name}__", _binary(f"__{_name}__", _ufunc))
    setattr(ndarray, f"__r{_name}__", _binary(f"__r{_name}__", _ufunc, reflected=True))
    setattr(ndarray, f"__i{_name}__", _binary(f"__i{_name}__", _ufunc, inplace=True))
setattr(ndarray, "__divmod__", _binary("__divmod__", _np.divmod))  # noqa: B010
setattr(ndarray, "__rdivmod__", _binary("__rdivmod__", _np.divmod, reflected=True))  # noqa: B010
for _name, _ufunc in {
    "eq": _np.equal,
    "ne": _np.not_equal,
    "lt": _np.less,
    "le": _np.less_equal,
    "gt": _np.greater,
    "ge": _np.greater_equal,
}.items():
    setattr(ndarray, f"__{_name}__", _binary(f"__{_name}__", _ufunc))
for _name, _ufunc in {
    "neg": _np.negative,
    "pos": _np.positive,
    "abs": _np.absolute,
    "invert": _np.invert,
}.items():
    setattr(
        ndarray,
        f"__{_name}__",
        (lambda u, n: lambda self: _call(n, u, (self,), {}))(_ufunc, f"__{_name}__"),
    )
ndarray.__hash__ = None  # type: ignore[assignment]


# -- module functions -------------------------------------------------------------------------


def asarray(a: Any, dtype: Any = None, order: Any = None, *, blocking: bool = False) -> Any:
    if isinstance(a, ndarray):
        if a._lease.block.device != _sim.world().thread.device:
            a = a.copy(order="C" if order is None else order)  # moved, even without a copy
        if (dtype is None or _np.dtype(dtype) == a.dtype) and order in (None, "K", "A"):
            return a
        return _call("asarray", _np.asarray, (a,), {"dtype": dtype, "order": order})
    return _host_to_device(a, dtype, order)


def array(
    obj: Any,
    dtype: Any = None,
    copy: bool = True,
    order: str = "K",
    subok: bool = False,
    ndmin: int = 0,
    *,
    blocking: bool = False,
) -> Any:
    if isinstance(obj, ndarray):
        if obj._lease.block.device != _sim.world().thread.device:
            moved = obj.copy(order="C" if order == "K" else order)
            return moved if dtype is None else moved.astype(dtype, copy=False)
        if not copy and (dtype is None or _np.dtype(dtype) == obj.dtype):
            return obj
        return _call("array", _np.array, (obj,), {"dtype": dtype, "copy": True, "order": order})
    return _host_to_device(_np.array(obj, dtype=dtype, order=order, ndmin=ndmin))  # type: ignore[call-overload]


def asnumpy(
    a: Any, stream: Any = None, order: str = "C", out: Any = None, *, blocking: bool = True
) -> Any:
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    result = _np.asarray(a, order=order)  # type: ignore[call-overload]
    if out is not None:
        out[...] = result
        return out
    return result


def copy(a: Any, order: str = "K") -> Any:
    """``a.copy(order=order)`` (``cupy/_creation/from_data.py``)."""
    return a.copy(order=order)


def get_array_module(*args: Any) -> Any:
    return _this if any(isinstance(a, ndarray) for a in args) else _np


class _MemoryPool:
    def used_bytes(self) -> int:
        world = _sim.world()
        return sum(block.size for block in world.blocks.values() if block.live)

    def total_bytes(self) -> int:
        return sum(block.size for block in _sim.world().blocks.values())

    def free_all_blocks(self, stream: Any = None) -> None:
        pass

    def n_free_blocks(self) -> int:
        return sum(len(blocks) for blocks in _sim.world().free_blocks.values())


_pool = _MemoryPool()


def get_default_memory_pool() -> _MemoryPool:
    return _pool


#: Functions that write their first argument in place and return ``None``.
_IN_PLACE = frozenset({"copyto", "putmask", "place", "put", "fill_diagonal", "put_along_axis"})


def _wrapped(name: str, function: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        if name in _IN_PLACE and args and isinstance(args[0], ndarray):
            return _call(name, function, args, kwargs, writes=(args[0],), only_writes=True)
        return _call(name, function, args, kwargs)

    kernel.__name__ = name
    kernel.__qualname__ = name
    return kernel


class _Namespace(types.ModuleType):
    """``cupy.linalg`` and friends: NumPy's functions of the same name, run as kernels."""

    def __init__(self, name: str, source: Any) -> None:
        super().__init__(name)
        self._source = source

    def __getattr__(self, name: str) -> Any:
        function = getattr(self._source, name)
        if not callable(function) or isinstance(function, type):
            return function
        kernel = _wrapped(name, function)
        setattr(self, name, kernel)
        return kernel


linalg = _Namespace("cupy.linalg", _np.linalg)
fft = _Namespace("cupy.fft", _np.fft)
_this: Any = None


def __getattr__(name: str) -> Any:
    """NumPy's constants and types as they are; its functions and ufuncs run as kernels."""
    if name.startswith("__"):
        raise AttributeError(name)
    attribute = getattr(_np, name, None)
    if attribute is None:
        raise AttributeError(f"module 'cupy' has no attribute {name!r}")
    if isinstance(attribute, type) or not callable(attribute):
        return attribute
    if name in ("dtype", "iinfo", "finfo", "result_type", "can_cast", "promote_types"):
        return attribute
    kernel = _wrapped(name, attribute)
    globals()[name] = kernel
    return kernel


import sys as _sys  # noqa: E402

_this = _sys.modules[__name__]
