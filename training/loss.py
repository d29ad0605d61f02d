"""The token loss: mean next-token cross-entropy (nats), fp32, with the optional z-loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def cross_entropy(logits: jax.Array, targets: jax.Array, z_loss: float) -> jax.Array:
    """Mean over [b, L] of CE(logits [b, L, V] fp32, targets [b, L]) + z_loss·logsumexp²."""
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    if z_loss:
        loss += z_loss * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return loss
