"""The token loss: mean next-token cross-entropy (nats), fp32, with the optional z-loss.

The targets enter as one-hot rows (optax's dense-label cross-entropy), not as indices: optax's
integer-label version takes the target logit with a gather, and a gather from logits whose V is
split over `tensor` makes XLA's SPMD partitioner abort inside the 1f1b pipeline program
(partially manual over `stage`, jax 0.10). One-hot against V-split logits is elementwise: each
device sums its own V/T slice and XLA all-reduces a [b, L] partial, Megatron's vocab-parallel
cross-entropy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def cross_entropy(logits: jax.Array, targets: jax.Array, z_loss: float) -> jax.Array:
    """Mean over [b, L] of CE(logits [b, L, V] fp32, targets [b, L]) + z_loss·logsumexp²."""
    labels = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
    loss = optax.softmax_cross_entropy(logits, labels).mean()
    if z_loss:
        loss += z_loss * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return loss
