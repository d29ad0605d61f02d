"""The token loss: mean next-token cross-entropy (nats), fp32, with the optional z-loss.

Written without a gather (optax's integer-label cross-entropy takes the target logit with
take_along_axis): the target logit is a masked sum over V. With the vocab split over `tensor`
each device sums its own V/T slice and XLA all-reduces a [b, L] partial, Megatron's
vocab-parallel cross-entropy; a gather from V-split logits instead makes XLA's SPMD partitioner
abort inside the 1f1b pipeline program (partially manual over `stage`, jax 0.10). Not optax's
dense version on one-hot labels either: XLA materializes the one-hot and log-softmax [b, L, V]
buffers, +32 MiB of peak on 125m at dp=2,fsdp=2,tp=2 (903.5 vs 871.5 MiB, the same as the
gather's), enough to fail tests/test_plan.py's memory check; the masked sum fuses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits: jax.Array, targets: jax.Array, z_loss: float,
                  weights: jax.Array | None = None) -> jax.Array:
    """Mean over [b, L] of CE(logits [b, L, V] fp32, targets [b, L]) + z_loss·logsumexp², each
    position's term times `weights` [b, L] where given (0 drops a row: a pipeline's padding,
    pipeline.circular.head_loss)."""
    log_z = jax.nn.logsumexp(logits, axis=-1)  # [b, L]
    vocab = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
    target = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), axis=-1)  # [b, L]
    weighted = (lambda a: a) if weights is None else (lambda a: weights * a)  # noqa: E731
    loss = jnp.mean(weighted(log_z - target))
    if z_loss:
        loss += z_loss * jnp.mean(weighted(log_z**2))
    return loss
