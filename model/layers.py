"""Building blocks: parameters with logical names, softmax, RMSNorm, token embedding, rotary
embedding.

Parameters are created in `param_dtype` (fp32 by default) and used in whatever dtype the caller
casts them to (the train step casts the whole tree to the compute dtype, bf16 by default).
Norms and the rotary rotation run in fp32 whatever the compute dtype.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from sharding.rules import constrain
from sharding.vocab_parallel import vocab_parallel_take


def param(rngs: nnx.Rngs, shape: Sequence[int], names: Sequence[str | None], std: float,
          dtype: jnp.dtype) -> nnx.Param:
    """A normal(0, std) parameter annotated with logical axis names (std 0 -> ones, for norms).

    eager_sharding=False: shardings are applied by the caller (jit out_shardings from
    sharding.rules), so a model can be built abstractly or on one device without a mesh.
    """
    if std == 0.0:
        value = jnp.ones(shape, dtype)
    else:
        value = std * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """jax.nn.softmax differentiated by its custom JVP on every jax: the backward,
    y * (g - sum(g * y)), reads the output y alone. jax <= 0.11 differentiates through exp and
    the division by default (jax_softmax_custom_jvp=False), which keeps exp(x - max) beside y: for
    the xla attention core one more fp32 [B, N, L, L] stack per layer (XLA CPU, tiny on fsdp=8:
    2 MiB more at the peak on jax 0.11.2, 0 on 0.12.1, which has only the custom JVP)."""
    with jax.softmax_custom_jvp(True):
        return jax.nn.softmax(x, axis=axis)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over D, computed in fp32. scale: [D] ('norm')."""

    def __init__(self, d: int, eps: float, dtype: jnp.dtype, *, rngs: nnx.Rngs):
        self.scale = param(rngs, (d,), ("norm",), 0.0, dtype)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class Embed(nnx.Module):
    """Token lookup. table: [V, D] ('vocab', 'embed')."""

    def __init__(self, vocab: int, d: int, std: float, dtype: jnp.dtype, *, rngs: nnx.Rngs):
        self.table = param(rngs, (vocab, d), ("vocab", "embed"), std, dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        # Gather the table's D (the FSDP all-gather, made explicit): a lookup from a table split
        # on D into activations split on B would otherwise make XLA replicate the whole table.
        table = constrain(self.table[...], ("vocab", None))
        return jnp.take(table, tokens, axis=0)  # [B, L] -> [B, L, D]

    def vocab_parallel(self, tokens: jax.Array, sequence_parallel: bool = False,
                       dtype: DTypeLike | None = None) -> jax.Array:
        """The same lookup written per tensor shard (Megatron's vocab-parallel embedding): each
        device looks up the tokens in its own V/T rows, zeros the others, and one psum over the
        tensor axis ([B, L, D]; a reduce-scatter over L under sequence parallelism) assembles
        the rows, cast to `dtype` as taken. The explicit tensor-parallel runs use it: XLA's own
        lookup from a vocab-split table all-gathers the table under SP, and aborts inside the
        1f1b stage region on jax 0.12."""
        return vocab_parallel_take(self.table[...], tokens, sequence_parallel, dtype)


def rotary(length: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [L, H/2] for positions 0..L-1 (fp32)."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (x[:H/2], x[H/2:]) of x: [B, L, heads, H] by the position's angle."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
