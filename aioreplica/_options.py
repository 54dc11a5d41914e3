"""The small vocabulary every layer shares: reduction ops and communication options.

``CaseInsensitiveStrEnum`` is the base of every enum whose members users may also spell as
strings (``ReduceOp``, ``CommunicationImplementation``, ``VariableSynchronization``,
``VariableAggregation``).
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from typing import Final, Self

from ._errors import as_real, checked_integer

__all__ = [
    "DEFAULT_PACK_BYTES",
    "CaseInsensitiveStrEnum",
    "CommunicationImplementation",
    "CommunicationOptions",
    "ReduceOp",
]

#: Pack size when ``CommunicationOptions.bytes_per_pack`` is 0 (let aioreplica choose).
DEFAULT_PACK_BYTES: Final = 4 << 20


class CaseInsensitiveStrEnum(enum.StrEnum):
    """A string enum whose ``parse`` and constructor take a member or its value in any case.

    The base of ``ReduceOp``, ``CommunicationImplementation``, ``VariableSynchronization`` and
    ``VariableAggregation``: each member's value is its name in lower case, so names and
    values both parse, and TF's ``ReduceOp("SUM")`` (whose values are the upper-case names)
    is ``ReduceOp.SUM`` here too.
    """

    @classmethod
    def _missing_(cls, value: object) -> Self:
        """The member ``value`` names in another case; an unknown one raises ``parse``'s
        error, which lists the valid values, instead of enum's bare one."""
        return cls._named(value)

    @classmethod
    def parse(cls, value: Self | str) -> Self:
        """Return ``value`` as a member; strings are matched without regard to case.

        Raises:
            ValueError: ``value`` names no member; the message lists the valid ones.

        Example:
            >>> ReduceOp.parse("MEAN")
            <ReduceOp.MEAN: 'mean'>
        """
        if isinstance(value, cls):
            return value
        return cls._named(value)

    @classmethod
    def _named(cls, value: object) -> Self:
        """The member a string names, in any case.

        Raises:
            ValueError: ``value`` names no member; the message lists the valid ones.
        """
        if isinstance(value, str):
            member = cls._value2member_map_.get(value) or cls._value2member_map_.get(value.lower())
            if member is not None:
                return member  # type: ignore[return-value]  # a member of cls
        what = re.sub(r"(?<!^)(?=[A-Z])", " ", cls.__name__).lower()  # ReduceOp: "reduce op"
        valid = ", ".join(repr(member.value) for member in cls)
        raise ValueError(f"unknown {what} {value!r}: use a {cls.__name__} or one of {valid}")


class ReduceOp(CaseInsensitiveStrEnum):
    """How values are combined across replicas. Strings (``"sum"``, ...) are accepted too, in
    any case, by the functions that take an op and by the constructor, as TF's
    ``ReduceOp("SUM")``.

    Raises:
        ValueError: ``ReduceOp(value)`` of a value that names no op; the message lists the
            valid ones.

    Example:
        >>> ReduceOp.parse("mean")
        <ReduceOp.MEAN: 'mean'>
        >>> ReduceOp("SUM")
        <ReduceOp.SUM: 'sum'>
        >>> ReduceOp("total")
        Traceback (most recent call last):
        ...
        ValueError: unknown reduce op 'total': use a ReduceOp or one of 'sum', 'mean', 'max', \
'min', 'prod'
    """

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"
    PROD = "prod"

    @staticmethod
    def from_variable_aggregation(aggregation: object) -> ReduceOp:
        """The op of a variable aggregation (``VariableAggregation`` or its name), as TF's:
        ``SUM`` and ``MEAN`` have one; ``NONE`` and ``ONLY_FIRST_REPLICA`` have none.

        Raises:
            ValueError: ``aggregation`` has no reduce op, or is no aggregation.

        Example:
            >>> ReduceOp.from_variable_aggregation(aioreplica.VariableAggregation.MEAN)
            <ReduceOp.MEAN: 'mean'>
        """
        name = getattr(aggregation, "value", aggregation)
        if isinstance(name, str) and name.lower() in ("sum", "mean"):
            return ReduceOp(name.lower())
        raise ValueError(
            f"cannot convert the variable aggregation {aggregation!r} to a ReduceOp: only "
            "SUM and MEAN have one (as in TF)"
        )


class CommunicationImplementation(CaseInsensitiveStrEnum):
    """Which transport collectives should use: TF's hint, under TF's names.

    Accepted so that TF programs run unchanged. aioreplica picks the transport itself, whatever
    the member: NumPy on host devices, NCCL between the GPUs of one process, MPI between the
    workers of a ``MultiWorkerMirroredStrategy`` (GPU replicas staged through the host; NCCL
    across workers is not built yet). TF treats it as a hint too: its ``NCCL`` falls back to
    its ring on CPUs and for all-gather and broadcast. Strings (``"nccl"``, ``"NCCL"``) are
    accepted too, by ``CommunicationOptions`` and by the constructor, as TF's
    ``CommunicationImplementation("NCCL")``.

    Raises:
        ValueError: ``CommunicationImplementation(value)`` of a value that names no member;
            the message lists the valid ones.

    Example:
        >>> CommunicationImplementation.parse("NCCL")
        <CommunicationImplementation.NCCL: 'nccl'>
        >>> CommunicationImplementation("RING")
        <CommunicationImplementation.RING: 'ring'>
    """

    AUTO = "auto"
    RING = "ring"
    NCCL = "nccl"


@dataclass(frozen=True, slots=True)
class CommunicationOptions:
    """How collectives communicate; given to a strategy, or to one call to override it.

    Attributes:
        bytes_per_pack: small tensors are fused into packs of at most this many bytes and
            reduced together; 0 lets aioreplica choose (``DEFAULT_PACK_BYTES``, 4 MiB).
        timeout_seconds: how long replicas wait at a collective (the context's collectives,
            and a variable write, ``update()`` or an optimizer step in a replica) for the
            others to arrive before the run fails with ``ReplicaSyncError`` naming the late
            replicas; across workers, the strategy's also bounds the wait for a late worker
            in its cross-replica calls (``strategy.reduce``, ``gather``, ``reduce_to``, a
            write outside ``run()``). 0 waits as long as it takes, as in TF: in a call's
            options it also turns off the strategy's timeout (its options' and its
            ``sync_timeout``) for that call, and in the strategy's options its
            ``sync_timeout`` for collectives. ``None`` leaves the timeout to the strategy (a
            call's options) or to ``sync_timeout`` (the strategy's). The reduction's own work,
            once all have arrived, is never timed out.
        implementation: a ``CommunicationImplementation`` or its name, TF's hint for the
            transport (``AUTO`` by default); accepted so that TF programs run unchanged, and
            aioreplica chooses the transport itself (see ``CommunicationImplementation``).

    Raises:
        ValueError: a negative ``bytes_per_pack``, a negative, infinite (or NaN)
            ``timeout_seconds`` or an unknown ``implementation`` (the message lists the valid
            ones).
        TypeError: ``bytes_per_pack`` is not an int or ``timeout_seconds`` not a number (a
            bool is neither).

    Example:
        >>> CommunicationOptions(bytes_per_pack=1 << 20, timeout_seconds=30.0).bytes_per_pack
        1048576
        >>> CommunicationOptions(implementation="NCCL").implementation
        <CommunicationImplementation.NCCL: 'nccl'>
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation | str = CommunicationImplementation.AUTO

    def __post_init__(self) -> None:
        packing = checked_integer(
            self.bytes_per_pack, "bytes_per_pack must be an int >= 0 (0: automatic)", 0
        )
        object.__setattr__(self, "bytes_per_pack", packing)  # a NumPy integer as an int
        if self.timeout_seconds is not None:
            timeout = as_real(self.timeout_seconds)
            requirement = "timeout_seconds must be a number of seconds >= 0 (0: no timeout) or None"
            if timeout is None:
                raise TypeError(
                    f"{requirement}, got {type(self.timeout_seconds).__name__} "
                    f"{self.timeout_seconds!r:.60}"
                )
            if not timeout >= 0:  # (NaN is not)
                raise ValueError(f"{requirement}, got {self.timeout_seconds!r}")
            if math.isinf(timeout):
                raise ValueError(
                    f"{requirement}, got {self.timeout_seconds!r:.60}, which is infinite or "
                    "too large: for no timeout pass 0"
                )
            object.__setattr__(self, "timeout_seconds", timeout)
        implementation = CommunicationImplementation.parse(self.implementation)
        object.__setattr__(self, "implementation", implementation)

    @property
    def _timeout(self) -> float | None:
        """How long a collective waits: ``None`` where these options set no timeout (the
        strategy's ``sync_timeout`` then applies), infinity for ``timeout_seconds`` 0, which
        waits as long as it takes whatever ``sync_timeout`` says."""
        return math.inf if self.timeout_seconds == 0 else self.timeout_seconds

    def override(self, other: CommunicationOptions | None) -> CommunicationOptions:
        """These options with the fields that ``other`` sets (non-default) taking precedence.

        Raises:
            TypeError: ``other`` is neither ``CommunicationOptions`` nor ``None``.

        Example:
            >>> options = CommunicationOptions(bytes_per_pack=1024).override(
            ...     CommunicationOptions(timeout_seconds=5.0)
            ... )
            >>> options.bytes_per_pack, options.timeout_seconds
            (1024, 5.0)
        """
        if other is None:
            return self
        if not isinstance(other, CommunicationOptions):
            raise TypeError(
                f"options must be a CommunicationOptions or None, got {type(other).__name__} "
                f"{other!r:.60}"
            )
        return CommunicationOptions(
            bytes_per_pack=other.bytes_per_pack or self.bytes_per_pack,
            timeout_seconds=(
                other.timeout_seconds if other.timeout_seconds is not None else self.timeout_seconds
            ),
            implementation=(
                other.implementation
                if other.implementation is not CommunicationImplementation.AUTO
                else self.implementation
            ),
        )

    def merge(self, options: CommunicationOptions | None) -> CommunicationOptions:
        """Merges with another options and returns a new one: TF's name of ``override``.

        Values specified in ``options`` take precedence if they're not the default.

        Args:
            options: a ``CommunicationOptions`` (or ``None``, which changes nothing).

        Returns:
            A new ``CommunicationOptions``.

        Raises:
            TypeError: ``options`` is neither ``CommunicationOptions`` nor ``None``.

        Example:
            >>> merged = CommunicationOptions(bytes_per_pack=1024).merge(
            ...     CommunicationOptions(timeout_seconds=5.0, implementation="NCCL")
            ... )
            >>> merged.bytes_per_pack, merged.timeout_seconds, merged.implementation
            (1024, 5.0, <CommunicationImplementation.NCCL: 'nccl'>)
        """
        return self.override(options)
