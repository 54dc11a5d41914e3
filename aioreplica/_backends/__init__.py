"""Device backends and device names.

``canonical_device_name`` turns every accepted spelling into one canonical name (``"cpu:1"``,
``"gpu:0"``); ``resolve_devices`` turns what a user passed to a strategy into device objects.
Only the host backend exists so far; GPU names parse but are refused with advice.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ._numpy import HostDevice
from ._protocol import Device

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["Device", "HostDevice", "canonical_device_name", "list_devices", "resolve_devices"]

# Accepts "cpu:1", "CPU:1", "/cpu:1", "/device:CPU:1", "cuda:0", "gpu:0", "/gpu:0", and TF's full
# form "/job:localhost/replica:0/task:0/device:GPU:0" (only the device part is kept).
_DEVICE_RE = re.compile(
    r"^(?:/job:[^/]+)?(?:/replica:\d+)?(?:/task:\d+)?(?:/?device:|/)?(cpu|gpu|cuda):(\d+)$",
    re.IGNORECASE,
)

_VALID = (
    "valid names are logical host devices 'cpu:0', 'cpu:1', ... (TF spellings such as "
    "'/device:CPU:1' are accepted too)"
)


def canonical_device_name(name: str) -> str:
    """Return the canonical spelling of a device name.

    Args:
        name: ``"cpu:1"``, ``"/device:CPU:1"``, ``"/cpu:1"``, ``"CPU:1"``, ``"gpu:0"``,
            ``"cuda:0"``, ``"/gpu:0"`` and TF's ``"/job:.../device:GPU:0"`` are understood.

    Returns:
        ``"cpu:<i>"`` or ``"gpu:<i>"``.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is not a device name.

    Example:
        >>> canonical_device_name("/device:CPU:1")
        'cpu:1'
        >>> canonical_device_name("cuda:0")
        'gpu:0'
    """
    if not isinstance(name, str):
        raise TypeError(f"a device name must be a str, got {type(name).__name__} {name!r}")
    match = _DEVICE_RE.match(name.strip())
    if match is None:
        raise ValueError(f"unknown device {name!r}: {_VALID}")
    kind = match.group(1).lower()
    return f"{'gpu' if kind == 'cuda' else kind}:{int(match.group(2))}"


def list_devices() -> list[str]:
    """Return the canonical names of the devices that exist in this process.

    Returns:
        ``["cpu:0"]`` on a host without a GPU backend.

    Example:
        >>> list_devices()
        ['cpu:0']
    """
    return ["cpu:0"]


def _device_for(name: str) -> Device:
    canonical = canonical_device_name(name)
    kind, _, index = canonical.partition(":")
    if kind == "cpu":
        return HostDevice(int(index))
    raise ValueError(
        f"device {name!r} ({canonical}) is not available: GPU devices need the CUDA backend, "
        f"which this version does not have yet; the devices here are {list_devices()}, and "
        "any number of logical host devices 'cpu:0', 'cpu:1', ... can be laid out on them"
    )


def resolve_devices(devices: Sequence[str | Device] | None) -> tuple[Device, ...]:
    """Turn a strategy's ``devices`` argument into device objects.

    Args:
        devices: device names or objects implementing the ``Device`` protocol; ``None``
            means the default devices (one host device, ``cpu:0``, for now).

    Returns:
        One device per replica, in replica order.

    Raises:
        TypeError: ``devices`` is a single string, or an entry is neither a name nor a device.
        ValueError: a name is unknown or unavailable, the sequence is empty, or a device
            appears twice.

    Example:
        >>> [d.name for d in resolve_devices(["/device:CPU:0", "cpu:1"])]
        ['cpu:0', 'cpu:1']
    """
    if devices is None:
        return (HostDevice(0),)
    if isinstance(devices, str):
        raise TypeError(
            f"devices must be a sequence of device names, got the string {devices!r}; "
            f"write [{devices!r}]"
        )
    resolved: list[Device] = []
    for entry in devices:
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
    return tuple(resolved)
