"""Device backends and device names.

``canonical_device_name`` turns every accepted spelling into one canonical name (``"cpu:1"``,
``"gpu:0"``); ``resolve_devices`` turns what a user passed to a strategy into device objects.
The host backend (NumPy) is always there; the CUDA backend (CuPy) is imported only when a GPU
is asked for or listed, and never by ``import aioreplica``.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable, Mapping

from ._arrays import array_kind, array_module, host_array, is_array, is_cupy_array
from ._numpy import HOST_BACKEND, HostBackend, HostDevice, host_device, share_cores
from ._numpy import INLINE_BYTES as HOST_INLINE_BYTES
from ._protocol import ArrayBackend, Device

__all__ = [
    "HOST_BACKEND",
    "HOST_INLINE_BYTES",
    "ArrayBackend",
    "Device",
    "HostBackend",
    "HostDevice",
    "array_kind",
    "array_module",
    "canonical_device_name",
    "default_devices",
    "host_array",
    "host_device",
    "is_array",
    "is_cupy_array",
    "list_devices",
    "resolve_devices",
    "share_cores",
]

# Accepts "cpu:1", "CPU:1", "/cpu:1", "/device:CPU:1", "cuda:0", "gpu:0", "/gpu:0", and TF's full
# form "/job:localhost/replica:0/task:0/device:GPU:0" (only the device part is kept). Without an
# index ("/cpu", "/device:GPU") it is device 0, as TF canonicalises it. TF's "*" (any index) is
# matched only to be refused with its own message.
_DEVICE_RE = re.compile(
    r"^(?:/job:[^/]+)?(?:/replica:\d+)?(?:/task:\d+)?(?:/?device:|/)?(cpu|gpu|cuda)(?::(\d+|\*))?$",
    re.IGNORECASE,
)

_VALID = (
    "valid names are logical host devices 'cpu:0', 'cpu:1', ... and the GPUs CuPy sees, "
    "'gpu:0', 'gpu:1', ... (or 'cuda:0', ...); TF spellings such as '/device:CPU:1' and "
    "'/gpu:0' are accepted too"
)


def canonical_device_name(name: str) -> str:
    """Return the canonical spelling of a device name.

    Args:
        name: ``"cpu:1"``, ``"/device:CPU:1"``, ``"/cpu:1"``, ``"CPU:1"``, ``"gpu:0"``,
            ``"cuda:0"``, ``"/gpu:0"`` and TF's ``"/job:.../device:GPU:0"`` are understood; a
            name without an index (``"/cpu"``, ``"/device:GPU"``) is device 0, as in TF.

    Returns:
        ``"cpu:<i>"`` or ``"gpu:<i>"``.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is not a device name, or has TF's ``"*"`` (any device) for
            its index: each replica needs one device, named by its index.

    Example:
        >>> canonical_device_name("/device:CPU:1")
        'cpu:1'
        >>> canonical_device_name("cuda:0")
        'gpu:0'
        >>> canonical_device_name("/cpu")
        'cpu:0'
    """
    if not isinstance(name, str):
        raise TypeError(f"a device name must be a str, got {type(name).__name__} {name!r}")
    match = _DEVICE_RE.match(name.strip())
    if match is None:
        raise ValueError(f"unknown device {name!r}: {_VALID}")
    kind = match.group(1).lower()
    kind = "gpu" if kind == "cuda" else kind
    index = match.group(2) or "0"
    if index == "*":
        raise ValueError(
            f"device {name!r} has '*' (any device) for its index, which names no one device: "
            f"each replica runs on the device it names; name an index, e.g. '{kind}:0'"
        )
    return f"{kind}:{int(index)}"


def _gpu_count() -> int:
    """How many GPUs CuPy sees; 0 without CuPy (never imported when not installed), with a
    CuPy that cannot load, or without CUDA."""
    if importlib.util.find_spec("cupy") is None:
        return 0
    try:
        from . import _cupy
    except ImportError:  # installed, but it cannot load (a CUDA library missing, ...)
        return 0
    return _cupy.visible_device_count()


def list_devices() -> list[str]:
    """Return the canonical names of the devices that exist in this process.

    Every GPU that CuPy sees (``"gpu:0"``, ...), then ``"cpu:0"``. Logical host devices
    ``"cpu:1"``, ``"cpu:2"``, ... can be laid out on top of the host as well.

    Returns:
        The device names; ``["cpu:0"]`` on a host without CuPy or without a CUDA device.

    Example:
        >>> list_devices()[-1]
        'cpu:0'
    """
    return [f"gpu:{i}" for i in range(_gpu_count())] + ["cpu:0"]


def _device_for(name: str) -> Device:
    canonical = canonical_device_name(name)
    kind, _, number = canonical.partition(":")
    index = int(number)
    if kind == "cpu":
        return host_device(index)
    if importlib.util.find_spec("cupy") is None:
        raise ValueError(
            f"device {name!r} needs CuPy, which is not installed: "
            "pip install 'aioreplica[cuda]'; the devices here are "
            f"{list_devices()}"
        )
    try:
        from . import _cupy
    except ImportError as exc:
        raise ValueError(
            f"device {name!r} needs CuPy, which is installed but cannot be imported ({exc}); "
            "reinstall the cupy-cudaNNx wheel that matches your CUDA; the devices here are "
            f"{list_devices()}"
        ) from exc
    count = _gpu_count()
    if index >= count:
        raise ValueError(
            f"device {name!r} ({canonical}) does not exist: CuPy sees {count} GPU"
            f"{'' if count == 1 else 's'}; the devices here are {list_devices()}"
        )
    return _cupy.cuda_device(index)


_EXAMPLE_LIST = "['cpu:0', 'cpu:1']"


def _device_entries(devices: object) -> list[object]:
    """The entries of a ``devices`` argument, or a ``TypeError`` showing the list to write.

    TF's strategies take a list of device names; what else people pass by mistake is
    recognised here, so the message can say what to write instead.
    """
    if isinstance(devices, str | bytes | bytearray):
        raise TypeError(_names_in_one_string(devices))
    if isinstance(devices, set | frozenset):
        raise TypeError(
            f"devices must be a list of device names, got a {type(devices).__name__}, which has "
            "no order; replica ids follow the order of the list: pass a list in the order you "
            f"want, e.g. {sorted(devices, key=str)!r}"
        )
    if isinstance(devices, Mapping):
        raise TypeError(
            f"devices must be a list of device names such as {_EXAMPLE_LIST}, got a "
            f"{type(devices).__name__}"
        )
    if not isinstance(devices, Iterable):
        raise TypeError(_not_a_list(devices))
    return list(devices)


def _not_a_list(devices: object) -> str:
    """The message for a ``devices`` argument that cannot be iterated at all."""
    start = "devices must be a list of device names"
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        count = devices
        return (
            f"{start}, got the int {count}; for {count} replica{'s' if count > 1 else ''} on "
            f'this host write devices=[f"cpu:{{i}}" for i in range({count})]'
        )
    if isinstance(devices, Device):
        return f"{start}, got the device {devices!r}; write [device]"
    return f"{start} such as {_EXAMPLE_LIST}, got the {type(devices).__name__} {devices!r}"


def _names_in_one_string(text: str | bytes | bytearray) -> str:
    """The message for device names written as one string: the list they make, if any."""
    kind = "string" if isinstance(text, str) else type(text).__name__
    start = f"devices must be a list of device names, got the {kind} {text!r}"
    words = text if isinstance(text, str) else text.decode("ascii", errors="replace")
    names = [word for word in re.split(r"[\s,]+", words) if word]
    if names and all(_DEVICE_RE.match(name) for name in names):
        return f"{start}; write {names!r}"
    return f"{start}, which names no device; write a list such as {_EXAMPLE_LIST}; {_VALID}"


def default_devices() -> tuple[Device, ...]:
    """Every GPU that CuPy sees, else the one host device ``cpu:0``."""
    count = _gpu_count()
    if count:
        from . import _cupy

        return tuple(_cupy.cuda_device(i) for i in range(count))
    return (host_device(0),)


def resolve_devices(devices: Iterable[str | Device] | None) -> tuple[Device, ...]:
    """Turn a strategy's ``devices`` argument into device objects.

    Args:
        devices: a list (or tuple, or other ordered iterable) of device names or objects
            implementing the ``Device`` protocol; ``None`` means the default devices: every
            GPU CuPy sees, else ``cpu:0``.

    Returns:
        One device per replica, in replica order.

    Raises:
        TypeError: ``devices`` is not a list of devices: a number of replicas, a string (one
            name, or several in one string), one device object, a set (which has no order)
            or a mapping; the message shows the list to write. Or an entry is neither a name
            nor a device.
        ValueError: a name is unknown or unavailable, the sequence is empty, a device appears
            twice, or host and GPU devices are mixed.

    Example:
        >>> [d.name for d in resolve_devices(["/device:CPU:0", "cpu:1"])]
        ['cpu:0', 'cpu:1']
        >>> resolve_devices(2)
        Traceback (most recent call last):
        ...
        TypeError: devices must be a list of device names, got the int 2; for 2 replicas on \
this host write devices=[f"cpu:{i}" for i in range(2)]
    """
    if devices is None:
        return default_devices()
    entries = _device_entries(devices)
    resolved: list[Device] = []
    for entry in entries:
        if isinstance(entry, str):
            resolved.append(_device_for(entry))
        elif isinstance(entry, Device):
            resolved.append(entry)
        else:
            raise TypeError(
                f"each device must be a name such as 'cpu:0' or a Device, got "
                f"{type(entry).__name__} {entry!r}"
            )
    if not resolved:
        raise ValueError("devices must name at least one device; pass None for the default")
    seen: dict[str, int] = {}
    for position, device in enumerate(resolved):
        if device.name in seen:
            raise ValueError(
                f"device {device.name!r} appears twice (positions {seen[device.name]} and "
                f"{position}); every replica needs its own device"
            )
        seen[device.name] = position
    kinds = sorted({device.kind for device in resolved})
    if len(kinds) > 1:
        raise ValueError(
            f"devices mix kinds {kinds}: one strategy runs its replicas on devices of one kind "
            "(all host or all GPU), so that its collectives run on one backend"
        )
    return tuple(resolved)
