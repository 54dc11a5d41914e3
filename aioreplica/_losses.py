"""TF's loss scaling for synchronous training: ``compute_average_loss`` and
``scale_regularization_loss`` (``tf.nn``'s, which every ``tf.distribute`` tutorial uses).

Each replica computes its loss on its slice of the global batch; the gradients are then summed
across replicas (``ReduceOp.SUM``). So that the sum is the gradient of the mean loss over the
whole global batch, each replica divides its per-example losses' sum by the *global* batch size,
and a loss that every replica adds whole (a regularization term) by the number of replicas.
"""

from __future__ import annotations

from typing import Any, SupportsIndex

import numpy as np

from ._backends import array_module
from ._context import context_state, get_replica_context
from ._errors import checked_integer

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def compute_average_loss(
    per_example_loss: Any,
    sample_weight: Any = None,
    global_batch_size: SupportsIndex | None = None,
) -> Any:
    """Scale per-example losses by ``sample_weight`` and average them over the global batch,
    as TF's ``tf.nn.compute_average_loss``.

    Call it in the step function, on the replica's per-example losses: the result is their
    sum divided by ``global_batch_size``, so that the gradients summed across replicas are
    those of the mean loss over the whole global batch.

    Args:
        per_example_loss: the replica's losses, one (or one row) per example: a NumPy (or
            CuPy) array of at least one dimension, of floating-point numbers or integers, or
            what NumPy makes one of.
        sample_weight: a weight per example (or one for all), multiplied into the losses: it
            broadcasts against them, after, as TF does, dropping a trailing dimension of size
            1 that the losses lack or adding one that they have.
        global_batch_size: the examples of one step over every replica. ``None`` (the
            default, in replica context only): the replica's batch size (the losses' first
            dimension) times ``num_replicas_in_sync``, right when every replica gets a batch
            of the same size. Outside any strategy there is one replica.

    Returns:
        The scalar loss, of the losses' dtype (float64 for integer losses, as NumPy's and
        TF's division of int64s gives): their weighted sum divided by ``global_batch_size``;
        0 if ``global_batch_size`` is 0.

    Raises:
        RuntimeError: ``global_batch_size`` is ``None`` in a strategy's cross-replica context
            (its ``scope()`` or a ``merge_fn``), where there is no replica batch to count.
        ValueError: ``per_example_loss`` is a scalar number; ``sample_weight`` does not
            broadcast to it; ``global_batch_size`` is not a scalar, or is negative; an
            argument is ragged (lists of different lengths), which makes no array.
        TypeError: ``per_example_loss`` holds something other than numbers (bools
            included; ``None``, a string); ``sample_weight`` holds something other than
            numbers or bools; ``global_batch_size`` is not an int (NumPy's integers are; a
            bool is not).

    Example:
        >>> compute_average_loss(np.array([1.0, 2.0, 3.0]), global_batch_size=6)
        np.float64(1.0)
        >>> compute_average_loss(np.array([1.0, 3.0]), sample_weight=np.array([1.0, 0.0]))
        np.float64(0.5)
        >>> compute_average_loss([1, 2, 3, 4, 5], global_batch_size=10)  # integers, as TF's
        np.float64(1.5)
        >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> async def step(losses):
        ...     return compute_average_loss(losses)  # over a global batch of 2 x 2
        >>> losses = aioreplica.PerReplica([np.array([1.0, 2.0]), np.array([3.0, 4.0])])
        >>> anyio.run(strategy.run, step, (losses,))
        PerReplica({0: np.float64(0.75), 1: np.float64(1.75)})
    """
    xp = array_module(per_example_loss)
    losses = _as_array(xp, "compute_average_loss", "per_example_loss", per_example_loss)
    dtype = losses.dtype
    if losses.ndim < 1:
        if dtype.kind not in "iufc":  # no number at all: that, before its missing dimension
            raise _not_numbers("per_example_loss", per_example_loss, dtype)
        raise ValueError(
            f"compute_average_loss(): per_example_loss must have at least one dimension (one "
            f"loss per example), got a scalar {per_example_loss!r:.60}; for a loss already "
            "averaged, divide it by num_replicas_in_sync instead"
        )
    # The batch first: in cross-replica context that is the error TF raises, whatever the
    # losses hold.
    batch = _global_batch(len(losses), global_batch_size)
    if dtype.kind not in "iufc":
        raise _not_numbers("per_example_loss", per_example_loss, dtype)
    if sample_weight is not None:  # weighted in the losses' dtype, as TF casts them back
        weights = _as_array(xp, "compute_average_loss", "sample_weight", sample_weight)
        if weights.dtype.kind not in "biufc":  # TF casts bools to the losses' dtype too
            raise _not_numbers("sample_weight", sample_weight, weights.dtype)
        losses = (losses * _weights_for(losses, weights)).astype(dtype, copy=False)
    total = losses.sum(dtype=dtype)
    if batch == 0:  # TF's div_no_nan: no examples make no loss
        return xp.zeros((), dtype=np.float64 if dtype.kind in "iu" else dtype)[()]
    return total / dtype.type(batch)


def _as_array(xp: Any, caller: str, name: str, given: Any) -> Any:
    """``given``, ``caller``'s argument ``name``, as an array of ``xp``.

    Raises:
        ValueError: it is ragged (lists of different lengths), which makes no array; the
            message names the argument.
    """
    try:
        return xp.asarray(given)
    except ValueError as exc:
        raise ValueError(
            f"{caller}(): {name} makes no array ({exc}), got {type(given).__name__} "
            f"{given!r:.60}: pass an array, or lists of one length at each level"
        ) from None


def _not_numbers(name: str, given: Any, dtype: Any) -> TypeError:
    """The error for ``compute_average_loss``'s argument ``name``, ``given``, which NumPy
    makes an array of ``dtype``: no numbers (an array is shown with its dtype, anything else
    with its type)."""
    kind = dtype if hasattr(given, "dtype") else type(given).__name__
    return TypeError(
        f"compute_average_loss(): {name} must hold numbers, got {kind} {given!r:.60}: pass "
        f"numbers, or cast them first, e.g. np.asarray({name}, dtype=np.float32)"
    )


def _global_batch(replica_batch: int, global_batch_size: Any) -> int:
    """``compute_average_loss``'s ``global_batch_size``, checked, or the default for a
    replica batch of ``replica_batch`` examples.

    Raises:
        RuntimeError: no size is given in cross-replica context.
        ValueError: the size given is not a scalar, or is negative.
        TypeError: the size given is not an int.
    """
    if global_batch_size is None:
        context = get_replica_context()
        if context is None:
            raise RuntimeError(
                "compute_average_loss() was called without global_batch_size in the "
                f"cross-replica context of {context_state.get().strategy!r}, where there is "
                "no replica batch to count: call it in the step function, or pass "
                "global_batch_size"
            )
        return replica_batch * context.num_replicas_in_sync
    if _as_array(np, "compute_average_loss", "global_batch_size", global_batch_size).ndim != 0:
        raise ValueError(
            "compute_average_loss(): global_batch_size must be scalar, got "
            f"{type(global_batch_size).__name__} {global_batch_size!r:.60} of shape "
            f"{np.shape(global_batch_size)}; pass the number of examples as an int"
        )
    return checked_integer(
        global_batch_size, "compute_average_loss(): global_batch_size must be an int >= 0", 0
    )


def _weights_for(losses: Any, weights: Any) -> Any:
    """``weights`` shaped to multiply ``losses`` as TF's ``squeeze_or_expand_dimensions``
    shapes them: one trailing dimension of size 1 dropped, or one added, so that a weight
    per example multiplies every loss of its row.

    Raises:
        ValueError: they do not broadcast against the losses; nothing is computed.
    """
    given = tuple(weights.shape)
    if weights.ndim == losses.ndim + 1 and weights.shape[-1] == 1:
        weights = weights[..., 0]
    elif weights.ndim == losses.ndim - 1 and weights.ndim > 0:
        weights = weights[..., None]
    try:
        np.broadcast_shapes(losses.shape, weights.shape)
    except ValueError:
        raise ValueError(
            f"compute_average_loss(): sample_weight of shape {given} does not "
            f"broadcast to per_example_loss of shape {tuple(losses.shape)}; give one weight "
            "per example (the losses' first dimension), or one for all"
        ) from None
    return weights


def scale_regularization_loss(regularization_loss: Any) -> Any:
    """Divide the sum of ``regularization_loss`` by the number of replicas, as TF's
    ``tf.nn.scale_regularization_loss``.

    Every replica adds the whole regularization term to its loss, and the gradients are
    summed across replicas: dividing it by ``num_replicas_in_sync`` counts it once.

    Args:
        regularization_loss: a loss, or several (an array or list of them), summed.

    Returns:
        Their sum divided by ``num_replicas_in_sync`` (1 outside any strategy).

    Raises:
        RuntimeError: called in a strategy's cross-replica context (its ``scope()`` or a
            ``merge_fn``), as in TF: the term belongs in the step function.
        TypeError: ``regularization_loss`` holds something other than numbers (``None``,
            bools, strings).
        ValueError: ``regularization_loss`` is ragged (lists of different lengths).

    Example:
        >>> scale_regularization_loss([0.5, 1.5])
        np.float64(2.0)
        >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> async def step():
        ...     return scale_regularization_loss(np.float32(3.0))
        >>> anyio.run(strategy.run, step)
        PerReplica({0: np.float32(1.5), 1: np.float32(1.5)})
    """
    context = get_replica_context()
    if context is None:
        raise RuntimeError(
            "scale_regularization_loss() was called in the cross-replica context of "
            f"{context_state.get().strategy!r}; it scales a replica's term by the number of "
            "replicas: call it in the step function"
        )
    xp = array_module(regularization_loss)
    losses = _as_array(xp, "scale_regularization_loss", "regularization_loss", regularization_loss)
    if losses.dtype.kind not in "iufc":
        raise TypeError(
            "scale_regularization_loss(): regularization_loss must be a number or numbers, "
            f"got {type(regularization_loss).__name__} {regularization_loss!r:.60} "
            f"(dtype {losses.dtype}); pass the regularization losses, e.g. sum(model.losses)"
        )
    total = losses.sum()
    return total / total.dtype.type(context.num_replicas_in_sync)
