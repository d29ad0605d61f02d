"""The token loss: mean next-token cross-entropy (nats), fp32, with the optional z-loss.

Written without a gather (optax's integer-label cross-entropy takes the target logit with
take_along_axis): the target logit is a masked sum over V. With the vocab split over `tensor`
each device sums its own V/T slice and XLA all-reduces a [b, L] partial, Megatron's
vocab-parallel cross-entropy; a gather from V-split logits instead makes XLA's SPMD partitioner
abort inside the 1f1b pipeline program (partially manual over `stage`, jax 0.10). Not optax's
dense version on one-hot labels either: XLA materializes the one-hot and log-softmax [b, L, V]
buffers, +32 MiB of peak on 125m at dp=2,fsdp=2,tp=2 (903.5 vs 871.5 MiB, the same as the
gather's), enough to fail tests/test_plan.py's memory check; the masked sum fuses.

The per-position terms (logsumexp and the target's logit) have a hand-written backward only to
order the step: autodiff's reads the fp32 logits for the softmax but not the terms themselves,
and XLA GPU then reduced the logits to the loss after the layer scan's backward, keeping them
[b, L, V] through it (1b scanned, 4 layers, 8 x 2048 tokens on one H100: 2 GiB of 11.4). The
backward waits for the terms (an optimization barrier), so the logits die before the scan.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits: jax.Array, targets: jax.Array, z_loss: float,
                  weights: jax.Array | None = None) -> jax.Array:
    """Mean over [b, L] of CE(logits [b, L, V] fp32, targets [b, L]) + z_loss·logsumexp², each
    position's term times `weights` [b, L] where given (0 drops a row: a pipeline's padding,
    pipeline.circular.head_loss)."""
    log_z, target = position_terms(logits, targets)  # [b, L] each
    weighted = (lambda a: a) if weights is None else (lambda a: weights * a)  # noqa: E731
    loss = jnp.mean(weighted(log_z - target))
    if z_loss:
        loss += z_loss * jnp.mean(weighted(log_z**2))
    return loss


@jax.custom_vjp
def position_terms(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [b, L, V] fp32, targets [b, L] -> (logsumexp over V, the target's logit), [b, L]
    each. The backward, g·softmax + h·onehot, waits for both (module docstring)."""
    return _terms(logits, targets)


def _terms(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.sum(jnp.where(_is_target(logits, targets), logits, 0.0), axis=-1)
    return log_z, target


def _is_target(logits: jax.Array, targets: jax.Array) -> jax.Array:
    vocab = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
    return vocab == targets[..., None]


def _terms_forward(logits: jax.Array, targets: jax.Array) -> tuple[tuple, tuple]:
    terms = _terms(logits, targets)
    return terms, (logits, targets, terms)


def _terms_backward(saved: tuple, g: tuple) -> tuple[jax.Array, None]:
    logits, targets, terms = saved
    (g_log_z, g_target), (log_z, _) = jax.lax.optimization_barrier((g, terms))
    softmax = jnp.exp(logits - log_z[..., None])
    dlogits = g_log_z[..., None] * softmax + jnp.where(_is_target(logits, targets), g_target[..., None], 0.0)
    return dlogits, None


position_terms.defvjp(_terms_forward, _terms_backward)
