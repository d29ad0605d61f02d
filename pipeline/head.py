"""The 1F1B family's head over the stages: the final norm, head and loss of one microbatch with
the vocabulary split over `stage` as well as `tensor` (the vocabulary parallelism of Yeung et al.
2024), run by every stage at the tick whose head stage (p-1; zbv's stage 0) runs the model's
last chunk's B (pipeline/one_f_one_b.py, step 2 of the tick).

On one stage the head is the longest cell of its M ticks, and in lock-step every stage waits
for it: for 1b on pp=4 (head 0.77 chunk forwards) zb-h1's lock-step bubble rose from 0.111 to
0.230. Split over the stages, each tick holding a head pays 1/p of it on every stage.

Layout, with t tensor ranks and p stages: the head [D, V] is split over tensor, rank r holding
the vocabulary columns r·V/t ... (r+1)·V/t - 1, and for the step each stage holds only its
columns of them [D, t·q] (pipeline/stage_weights.py), q = ceil(V/(t·p)) of each rank's V/t from
min(s·q, V/t - q) (`_start`); the columns below s·q, which stage s-1 holds too where p does not
divide V/t, count on s-1 alone (`valid`). Stored with D split over stage (sharding/rules.py) and
p dividing V/t, the columns come by an all-to-all over stage (`exchanges`) and the gradient of
the stage's columns goes back by another, where the whole head was gathered and its zero-padded
gradient reduce-scattered: 1/p of those bytes over stage, and of the head's over fsdp, and of
its compute-dtype copy and fp32 gradient for the step. Otherwise each stage slices its columns
from the whole head (`stage_columns`) and pads its gradient to the whole for the sum over stage
(`whole`).

Per head tick, on every stage (a = b·L·D elements of the microbatch's activations, c the
compute dtype's bytes; [b, L] statistics in fp32):
  forward   the head stage's chunk output broadcast, a psum over stage of it and zeros
            elsewhere (all-reduce of a·c); the final norm; the stage's logits [b, L, t·q] fp32
            (the tensor-parallel head, sharding/vocab_parallel.py); their max, pmax'd over
            stage, and the sums of exp and of the target logit, psum'd together ([2, b, L])
  backward  by hand from the statistics: dlogits = (softmax · (1 + 2·z·log Z) - onehot) / (b·L·M)
            on the stage's columns; the head's vjp from it (its gradient the stage's q
            columns, added in place), whose input gradient leaves the matmul in fp32, a partial
            sum over the vocabulary, summed over tensor (the head's region) and then stage in
            fp32 (all-reduce of a·4) before it is cast, as one device's matmul sums it before
            its cast; then the final norm's vjp, the same on every stage (its gradient counted
            on the head stage), whose input gradient is the last chunk's B cotangent there.
            Summed in the compute dtype, the p rounded partials made the layer gradients of
            1f1b on pp=2 in bf16 differ from gpipe's by 1.5e-3 (tests/test_pipeline_equal.py).
So 2 all-reduces of a and two of [b, L] over stage a microbatch, beside the ticks' permutes of a.
The collectives are explicit: the engine's region is unchecked (pipeline/stages.py), so autodiff
through a psum would transpose it to another psum, not to the identity.
The loss counts on the head stage alone (the engine sums it over stage). Memory: the logits and
their gradient [b, L, V/(t·p)] fp32, 1/p of what the head stage held; the head's columns and
their fp32 gradient for the step [D, V/(t·p)] a device, 1/p of the whole head's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from pipeline.stages import AXIS, stages, with_part
from sharding.rules import axis_size, constrain
from sharding.tensor_parallel import AXIS as TENSOR
from sharding.vocab_parallel import vocab_parallel_logits


def _start(s: jax.Array, per_rank: int, p: int) -> tuple[jax.Array, int]:
    """(the first of stage s's q = ceil(per_rank / p) columns within a tensor rank's per_rank, q)."""
    q = math.ceil(per_rank / p)
    return jnp.minimum(s * q, per_rank - q), q


def exchanges(spec: P, vocab: int) -> bool:
    """Whether the stage's columns of the head stored as `spec` (over the region's manual axes)
    come by all-to-all over stage: stage splits its D (its first dimension) and divides V/t."""
    first = spec[0] if len(spec) else None
    return AXIS in ((first,) if isinstance(first, str) else first or ()) and vocab // axis_size(TENSOR) % stages() == 0


def stage_columns(head: jax.Array) -> jax.Array:
    """The whole head [D, V] (split over tensor) -> the stage's columns [D, t·q] of it."""
    d, v = head.shape
    t = axis_size(TENSOR)
    start, q = _start(lax.axis_index(AXIS), v // t, stages())
    return lax.dynamic_slice_in_dim(head.reshape(d, t, v // t), start, q, axis=2).reshape(d, t * q)


def whole(g: jax.Array, vocab: int) -> jax.Array:
    """The gradient of the stage's columns [D, t·q] -> the whole head's [D, V], zero elsewhere."""
    d, t = g.shape[0], axis_size(TENSOR)
    start, q = _start(lax.axis_index(AXIS), vocab // t, stages())
    zeros = jnp.zeros((d, t, vocab // t), g.dtype)
    return lax.dynamic_update_slice_in_dim(zeros, g.reshape(d, t, q), start, axis=2).reshape(d, vocab)


def head_loss(model_of, local: nnx.State, y: jax.Array, target: jax.Array, z_loss: float, m_count: int,
              head_stage: int, vocab: int) -> tuple[jax.Array, dict, jax.Array]:
    """Final norm, head and loss of one microbatch over the stages, forward and backward (module
    docstring): `local["head"]` the stage's columns [D, t·q] of the V = `vocab` (split over
    tensor), y [b, L, D] the model's last chunk's output on `head_stage` (any value on the
    others), target [b, L]. Returns (the loss scaled 1/M; the gradients {"final_norm": its,
    both on the head stage, 0 elsewhere, "head": the stage's columns' [D, t·q]}; dy [b, L, D],
    the same on every stage). `model_of(local)` is the model."""
    s, p, t = lax.axis_index(AXIS), stages(), axis_size(TENSOR)
    y = lax.psum(jnp.where(s == head_stage, y, jnp.zeros_like(y)), AXIS)  # the broadcast
    start, q = _start(s, vocab // t, p)
    head = local["head"]
    column = jnp.arange(t * q)
    ids = column // q * (vocab // t) + start + column % q  # the vocabulary id of each of the stage's columns
    valid = start + column % q >= s * q  # not also stage s-1's

    def normed(norm, y):
        return model_of(with_part(local, "final_norm", norm)).final_norm(y)

    def logits_of(head, h):  # the input gradient in fp32, a partial sum over stage
        logits = vocab_parallel_logits(model_of(local).tp, h, head[...], jnp.float32)
        return constrain(logits, ("batch", "length", "vocab"))

    with jax.named_scope("head"):
        h, norm_pullback = jax.vjp(normed, local["final_norm"], y)
        logits, pullback = jax.vjp(logits_of, head, h)
        logits = jnp.where(valid, logits, -jnp.inf)
        top = lax.pmax(jnp.max(logits, axis=-1), AXIS)  # [b, L]
        e = jnp.exp(logits - top[..., None])
        hit = (ids == target[..., None]) & valid
        total, picked = lax.psum(jnp.stack([jnp.sum(e, -1), jnp.sum(jnp.where(hit, logits, 0.0), -1)]), AXIS)
        log_z = top + jnp.log(total)
        n = target.size * m_count
        loss = (jnp.sum(log_z - picked) + z_loss * jnp.sum(log_z**2)) / n
        dlogits = ((1 + 2 * z_loss * log_z)[..., None] * e / total[..., None] - hit) / n  # 0 where not valid
        d_head, dh = pullback(dlogits)
        d_norm, dy = norm_pullback(lax.psum(dh, AXIS).astype(h.dtype))
    mine = lambda a: jnp.where(s == head_stage, a, jnp.zeros_like(a))  # noqa: E731  (the same on every stage)
    return mine(loss), {"final_norm": jax.tree.map(mine, d_norm), "head": d_head}, dy

